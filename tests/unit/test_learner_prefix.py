"""Shared prompts (`learner.share_prefix`): each group's prefix computed once must leave the numbers as the
padded pass gives them."""

import random

import pytest
import torch

from services.learner.model import token_logprobs, token_logprobs_and_entropy
from services.learner.prefix import Prefix, decoder_tokens, group_ordered, shared_prefix_hidden, shared_prefixes
from tests.support.learner import make_config, untimed


def _grouped_inputs():
    """Two groups of three rows sharing 5 and 3 prompt tokens, ragged, and a row alone in its group."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 64, (7, 10), generator=gen)
    ids[0:3, :5] = ids[0, :5]
    ids[3:6, :3] = ids[3, :3]
    ids[4, 3] = ids[3, 3] + 1  # the second group's rows part after 3 tokens
    ids[5, 3] = ids[3, 3]
    mask = torch.zeros_like(ids)
    for row, n in enumerate((10, 7, 6, 10, 4, 9, 8)):
        mask[row, :n] = 1
    return ids, mask, torch.tensor([0, 0, 0, 1, 1, 1, 2])


def test_groups_share_their_longest_common_prefix_of_real_tokens():
    ids, mask, groups = _grouped_inputs()
    assert shared_prefixes(ids, mask, groups) == [Prefix((0, 1, 2), 5), Prefix((3, 4, 5), 3)]
    assert shared_prefixes(ids, mask, groups, min_tokens=4) == [Prefix((0, 1, 2), 5)]


def test_a_prefix_leaves_every_row_a_token_of_its_own():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    # identical rows share all but their last token; the short row caps the group's prefix at 1
    assert shared_prefixes(ids[:2], mask[:2], torch.tensor([0, 0])) == [Prefix((0, 1), 3)]
    assert shared_prefixes(ids, mask, torch.tensor([0, 0, 0])) == [Prefix((0, 1, 2), 1)]
    assert shared_prefixes(ids[:1], mask[:1], torch.tensor([0])) == []  # a group of one has nothing to share
    # no common first token: nothing shared
    assert (
        shared_prefixes(torch.tensor([[5, 6], [6, 6]]), torch.ones(2, 2, dtype=torch.long), torch.tensor([0, 0])) == []
    )


def _stats_and_grads(model, prefixes, chunk=5):
    ids, mask, _ = _grouped_inputs()
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs_and_entropy(model, ids, mask, chunk, prefixes=prefixes)
    weights = torch.linspace(-1.0, 1.0, lp.numel(), dtype=lp.dtype).reshape(lp.shape)
    ((lp * weights * mask).sum() + (ent * weights.flip(-1) * mask).sum()).backward()
    return lp.detach() * mask, ent.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shared_prefix_gives_the_padded_logprobs_entropy_and_gradients(tiny64):
    ids, mask, groups = _grouped_inputs()
    prefixes = shared_prefixes(ids, mask, groups)
    lp, ent, grads = _stats_and_grads(tiny64, None)
    lp_s, ent_s, grads_s = _stats_and_grads(tiny64, prefixes)
    torch.testing.assert_close(lp_s, lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_s, ent, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_s[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(tiny64, ids, mask, 5, prefixes=prefixes) * mask, lp)


def test_the_prefix_runs_once_per_group(tiny64):
    ids, mask, groups = _grouped_inputs()
    seen = []
    hook = tiny64.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        with torch.no_grad():
            shared_prefix_hidden(tiny64.get_decoder(), ids, mask, shared_prefixes(ids, mask, groups))
    finally:
        hook.remove()
    # group 0: its 5 shared tokens once, then 3 rows x 5; group 1: 3 tokens once, 3 rows x 7; the lone row alone
    assert seen == [(1, 5), (3, 5), (1, 3), (3, 7), (1, 10)]


def _group_trajectories(groups=3, size=4, seed=2):
    from services.common.trajectory import TrajectoryBuilder

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(3, 64) for _ in range(rng.randint(4, 9))]
        for _ in range(size):
            b = TrajectoryBuilder(env="smoke", task_index=g, group_id=f"g{g}", prompt_ids=prompt)
            ids = [rng.randrange(3, 64) for _ in range(rng.randint(1, 6))]
            b.add_model_turn(
                ids,
                [-rng.uniform(0.5, 5.0) for _ in ids],
                policy_version=0,
                text="",
                action="",
                action_valid=True,
                finish_reason="stop",
            )
            traj = b.finish(env_return=0.0, success=rng.random() < 0.5, stop_reason="done")
            traj.reward = rng.uniform(-1.0, 1.0)
            out.append(traj)
    return out


@pytest.mark.parametrize("algorithm", [{}, {"ppo_epochs": 1, "use_kl_loss": True, "kl_loss_coef": 0.1}])
def test_train_step_same_with_shared_prefix(model_dir, algorithm):
    from services.learner.trainer import PolicyTrainer

    trajs = _group_trajectories()
    chunked = {"logprob_chunk_tokens": 7}
    plain = PolicyTrainer(make_config(chunked, **algorithm), model_dir).train_step(trajs)
    shared = PolicyTrainer(make_config({**chunked, "share_prefix": True}, **algorithm), model_dir).train_step(trajs)
    assert untimed(shared).keys() == untimed(plain).keys()
    # 3 groups of 4 rows: each group's prompt runs once a micro-batch instead of once a row
    assert plain.pop("decoder_token_fraction") == 1.0
    assert 0.3 < shared.pop("decoder_token_fraction") < 0.9
    for key, value in untimed(plain).items():
        assert shared[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_interleaved_groups_share_as_much_as_ordered_ones(model_dir):
    """Episodes finish in any order, so a collected batch interleaves its groups; the trainer puts each group's
    rows together before it cuts micro-batches, so a micro-batch of 4 rows holds one whole group."""
    from services.learner.trainer import PolicyTrainer

    trajs = _group_trajectories()
    interleaved = [t for i in range(4) for t in trajs[i::4]]
    assert [t.group_id for t in interleaved[:4]] != [trajs[0].group_id] * 4
    assert [t.group_id for t in group_ordered(interleaved)] == [t.group_id for t in trajs]
    config = {"logprob_chunk_tokens": 7, "share_prefix": True}
    ordered = PolicyTrainer(make_config(config, micro_batch_size=4), model_dir).train_step(trajs)
    mixed = PolicyTrainer(make_config(config, micro_batch_size=4), model_dir).train_step(interleaved)
    assert mixed["decoder_token_fraction"] == pytest.approx(ordered["decoder_token_fraction"])
    assert mixed["loss"] == pytest.approx(ordered["loss"], rel=1e-4)


def test_decoder_tokens_counts_each_prefix_once():
    assert decoder_tokens(10, 3, []) == 30
    # rows 0-2 share 5 tokens: 5 + 3 x 5; row 3 alone: 10
    assert decoder_tokens(10, 4, [Prefix((0, 1, 2), 5)]) == 5 + 15 + 10


def test_shared_prefix_needs_padded_rows_the_chunked_head_and_no_recompute():
    with pytest.raises(ValueError, match="unset learner.pack_sequences"):
        make_config({"share_prefix": True, "pack_sequences": True})
    with pytest.raises(ValueError, match="logprob_chunk_tokens > 0"):
        make_config({"share_prefix": True, "logprob_chunk_tokens": 0})
    with pytest.raises(ValueError, match="unset learner.activation_checkpointing"):
        make_config({"share_prefix": True, "activation_checkpointing": True})
    assert make_config({"share_prefix": True}).learner.share_prefix
