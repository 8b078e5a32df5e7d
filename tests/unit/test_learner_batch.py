import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.trajectory import RecordError, TrajectoryBuilder, decode_batch, encode_batch
from services.learner.allocation import allocate
from services.learner.batch import TrainBatch, collate, entropy_from_logits, logprobs_from_logits

VOCAB = 16


class ToyCausalLM(torch.nn.Module):
    """logits[t] depends on tokens t and t-1 only, so prefixes are easy to evaluate one by one."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.cur = torch.randn(VOCAB, VOCAB, generator=gen)
        self.prev = torch.randn(VOCAB, VOCAB, generator=gen)

    def forward(self, ids):
        prev = torch.nn.functional.pad(ids[:, :-1], (1, 0))
        return self.cur[ids] + 0.5 * self.prev[prev]


def make_trajectories(seed, n, model=None, groups=3):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
        b = TrajectoryBuilder(env="t", task_index=0, group_id=f"grp-{rng.randrange(groups)}", prompt_ids=prompt)
        for _ in range(rng.randint(0, 3)):
            ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
            if model is None:
                lps = [-rng.random() for _ in ids]
            else:  # what a sampler reports: each token scored from its own prefix, one at a time
                lps = []
                for k, tok in enumerate(ids):
                    prefix = torch.tensor([list(b.record.token_ids) + ids[:k]])
                    lps.append(torch.log_softmax(model(prefix)[0, -1], -1)[tok].item())
            b.add_model_turn(
                ids, lps, policy_version=rng.randrange(5), text="", action="", action_valid=True, finish_reason="stop"
            )
            b.add_observation([rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))], env_reward=0.0)
        traj = b.finish(env_return=0.0, success=rng.random() < 0.5, stop_reason="done")
        traj.reward = rng.uniform(-2, 2)
        out.append(traj)
    return out


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 6), st.sampled_from(["last_token", "uniform_positive", "discounted"]))
def test_collate_matches_records_after_wire_round_trip(seed, n, allocation):
    trajs = list(decode_batch(encode_batch(make_trajectories(seed, n))).trajectories)
    batch = collate(trajs, pad_id=99, allocation=allocation, gamma=0.9)
    # a row ends at its last model token (the observation after it is never used); a row without one is whole
    mask = [list(t.loss_mask) for t in trajs]
    used = [max((j + 1 for j, m in enumerate(row) if m), default=len(row)) for row in mask]
    length = max(used)
    assert batch.input_ids.shape == (n, length) and batch.group_index.shape == (n,)
    group_ids: dict[str, int] = {}
    for i, t in enumerate(trajs):
        k = used[i]
        assert 1 not in mask[i][k:]  # nothing cut is a model token
        assert batch.input_ids[i].tolist() == list(t.token_ids)[:k] + [99] * (length - k)
        assert batch.attention_mask[i].tolist() == [1] * k + [0] * (length - k)
        assert batch.response_mask[i].tolist() == mask[i][:k] + [0] * (length - k)
        torch.testing.assert_close(batch.rollout_logprobs[i, :k], torch.tensor(list(t.logprobs)[:k]))
        segments = [(u.start, u.start + u.model_tokens) for u in t.turns if u.model_tokens]
        expected = allocate(allocation, mask[i], segments, t.reward, 0.9)
        assert not any(expected[k:])  # rewards sit on model tokens only
        torch.testing.assert_close(
            batch.token_rewards[i].double(), torch.tensor(expected[:k] + [0.0] * (length - k), dtype=torch.float64)
        )
        for u in t.turns:
            assert batch.policy_versions[i, u.start : u.start + u.model_tokens].eq(u.policy_version).all()
        assert batch.group_index[i] == group_ids.setdefault(t.group_id, len(group_ids))
        assert batch.rewards[i].item() == pytest.approx(t.reward, rel=1e-6)
        assert batch.success[i].item() == float(t.success)
    assert batch.rollout_logprobs[batch.response_mask == 0].abs().max() == 0


def test_shift_alignment_learner_logprobs_equal_sampler_logprobs():
    """Position t of the learner's logprobs is the logprob of token t, scored from tokens < t: the same
    number the sampler recorded when it generated token t."""
    model = ToyCausalLM()
    trajs = make_trajectories(3, 6, model=model)
    batch = collate(trajs, pad_id=0)
    learner = logprobs_from_logits(model(batch.input_ids), batch.input_ids)
    mask = batch.response_mask.bool()
    assert mask.sum() > 10
    torch.testing.assert_close(learner[mask], batch.rollout_logprobs[mask], rtol=1e-5, atol=1e-5)
    assert learner[:, 0].eq(0).all()
    # the same check, token by token, without the helper
    for i in range(batch.size):
        for t in range(1, batch.input_ids.shape[1]):
            expected = torch.log_softmax(model(batch.input_ids[i : i + 1, :t])[0, -1], -1)[batch.input_ids[i, t]]
            assert learner[i, t].item() == pytest.approx(expected.item(), abs=1e-5)


def test_entropy_alignment():
    model = ToyCausalLM()
    ids = torch.randint(0, VOCAB, (2, 7))
    ent = entropy_from_logits(model(ids))
    for t in range(1, 7):
        p = torch.softmax(model(ids[:, :t])[:, -1], -1)
        torch.testing.assert_close(ent[:, t], -(p * p.log()).sum(-1))
    assert ent[:, 0].eq(0).all()


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError):
        collate([], pad_id=0)
    traj = make_trajectories(1, 1)[0]
    traj.loss_mask[0] = 1
    with pytest.raises(RecordError):
        collate([traj], pad_id=0)


def test_select_and_to():
    batch = collate(make_trajectories(2, 4), pad_id=0)
    sub = batch.select(torch.tensor([2, 0]))
    assert isinstance(sub, TrainBatch) and sub.size == 2
    assert torch.equal(sub.input_ids[1], batch.input_ids[0])
    assert sub.to("cpu").input_ids.device.type == "cpu"


def _episodes(trailing: bool, seed: int = 5):
    """Two groups of three one-turn episodes; with `trailing`, each ends with the observation of a turn that
    never came (what an episode out of turns records)."""
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [rng.randrange(3, 60) for _ in range(6)]
        for _ in range(3):
            b = TrajectoryBuilder(env="t", task_index=g, group_id=f"g{g}", prompt_ids=prompt)
            ids = [rng.randrange(3, 60) for _ in range(rng.randint(2, 5))]
            lps = [-rng.uniform(0.5, 4.0) for _ in ids]
            b.add_model_turn(ids, lps, policy_version=0, text="", action="", action_valid=True, finish_reason="stop")
            observation = [rng.randrange(3, 60) for _ in range(7)]
            if trailing:
                b.add_observation(observation, env_reward=0.0)
            traj = b.finish(env_return=0.0, success=False, stop_reason="max_turns")
            traj.reward = rng.uniform(-1, 1)
            out.append(traj)
    return out


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_a_trailing_observation_changes_no_step_metric(model_dir, advantage):
    from services.learner.trainer import PolicyTrainer
    from tests.support.learner import make_config, untimed

    with_obs, without = _episodes(True), _episodes(False)
    assert collate(with_obs, 0).input_ids.shape == collate(without, 0).input_ids.shape
    config = make_config(None, advantage=advantage, ppo_epochs=2, use_kl_loss=True)
    a = untimed(PolicyTrainer(config, model_dir).train_step(with_obs))
    b = untimed(PolicyTrainer(config, model_dir).train_step(without))
    assert a.keys() == b.keys()
    for key, value in b.items():
        assert a[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
