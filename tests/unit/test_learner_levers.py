"""Scale levers of the learner: each must leave the numbers as they are without it."""

import pytest
import torch

from services.learner import levers
from services.learner.batch import collate
from services.learner.model import token_logprobs, token_logprobs_and_entropy
from services.learner.trainer import PolicyTrainer
from tests.support.learner import make_config, untimed
from tests.support.smoke import build_tiny_llama, synthetic_trajectories


def _inputs(batch=3, length=8):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded row
    return ids, mask


def _stats_and_grads(model, chunk):
    ids, mask = _inputs()
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs_and_entropy(model, ids, mask, chunk)
    weights = torch.linspace(-1.0, 1.0, lp.numel(), dtype=lp.dtype).reshape(lp.shape)
    ((lp * weights).sum() + (ent * weights.flip(-1)).sum()).backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 4, 5, 1000])  # 24 positions: divides, does not, larger than all
def test_chunked_logprobs_entropy_and_gradients_equal_dense(tiny64, chunk):
    lp, ent, grads = _stats_and_grads(tiny64, 0)
    lp_c, ent_c, grads_c = _stats_and_grads(tiny64, chunk)
    # a float64 model, but both paths take the log-softmax in float32: float32 rounding is the tolerance
    torch.testing.assert_close(lp_c, lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_c, ent, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_c.keys()
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(tiny64, ids, mask, chunk), lp, rtol=1e-6, atol=1e-6)


def test_chunked_backward_keeps_no_full_logits(tmp_path):
    """The autograd graph keeps no logits but the chunk's: each chunk's are recomputed in the backward."""
    from services.learner.model import load_model

    vocab, saved = 101, []
    model = load_model(str(build_tiny_llama(tmp_path / "m", vocab_size=vocab)))
    ids, mask = _inputs(batch=4, length=32)

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs_and_entropy(model, ids, mask, 16)
        chunked_saved = list(saved)
        saved.clear()
        token_logprobs_and_entropy(model, ids, mask, 0)
    assert any(s[-1:] == (vocab,) and s[0] * s[1] >= 4 * 31 for s in saved if len(s) == 3)  # the dense logits
    assert not [s for s in chunked_saved if s[-1:] == (vocab,) and s[0] != vocab]


def test_train_step_same_with_chunked_logprobs(model_dir):
    trajs = synthetic_trajectories(8, 4, seed=5)
    dense = PolicyTrainer(make_config({"logprob_chunk_tokens": 0}), model_dir).train_step(trajs)
    chunked = PolicyTrainer(make_config({"logprob_chunk_tokens": 7}), model_dir).train_step(trajs)
    assert untimed(chunked).keys() == untimed(dense).keys()
    for key, value in untimed(dense).items():
        assert chunked[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def _ragged_inputs():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 64, (4, 9), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate((9, 2, 6, 1)):  # full, short, middle, a lone token
        mask[row, :n] = 1
    return ids, mask


def _packed_stats_and_grads(model, pack, chunk=0):
    ids, mask = _ragged_inputs()
    model.zero_grad(set_to_none=True)
    lp, ent = token_logprobs_and_entropy(model, ids, mask, chunk, pack)
    weights = torch.linspace(-1.0, 1.0, lp.numel(), dtype=lp.dtype).reshape(lp.shape)
    ((lp * weights * mask).sum() + (ent * weights.flip(-1) * mask).sum()).backward()
    return lp.detach() * mask, ent.detach() * mask, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [0, 5])
def test_packed_rows_give_the_padded_logprobs_entropy_and_gradients(tiny64, chunk):
    from services.learner.packing import pack_rows

    ids, mask = _ragged_inputs()
    rows = pack_rows(ids, mask)
    assert rows.input_ids.shape == (1, 18) and rows.position_ids[0].tolist()[:11] == [*range(9), 0, 1]
    lp, ent, grads = _packed_stats_and_grads(tiny64, False, chunk)
    lp_p, ent_p, grads_p = _packed_stats_and_grads(tiny64, True, chunk)
    assert (lp_p[:, 0] == 0).all() and (lp_p[mask == 0] == 0).all()
    torch.testing.assert_close(lp_p, lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_p, ent, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_p[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def tiny64_varlen(model_dir):
    from services.learner.model import load_model

    return load_model(model_dir, "float32", "varlen").double()


@pytest.mark.parametrize("chunk", [0, 5])
def test_varlen_attention_gives_the_padded_logprobs_entropy_and_gradients(tiny64, tiny64_varlen, chunk, monkeypatch):
    from services.learner import varlen_attention
    from services.learner.packing import pack_rows

    ids, mask = _ragged_inputs()
    rows = pack_rows(ids, mask)
    assert rows.cu_seqlens.tolist() == [0, 9, 11, 17, 18] and rows.max_len == 9
    seen = []
    per_document = varlen_attention._per_document
    monkeypatch.setattr(
        varlen_attention, "_per_document", lambda q, k, v, b, s: seen.append(b) or per_document(q, k, v, b, s)
    )
    lp, ent, grads = _packed_stats_and_grads(tiny64, False, chunk)
    lp_v, ent_v, grads_v = _packed_stats_and_grads(tiny64_varlen, True, chunk)
    assert seen and all(bounds == [0, 9, 11, 17, 18] for bounds in seen)  # each document alone, no mask
    torch.testing.assert_close(lp_v, lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_v, ent, rtol=1e-6, atol=1e-6)
    for name in grads:
        torch.testing.assert_close(grads_v[name], grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_varlen_attention_refuses_rows_that_are_not_packed(tiny64_varlen):
    ids, mask = _ragged_inputs()
    with pytest.raises(ValueError, match="learner.pack_sequences"):
        token_logprobs(tiny64_varlen, ids, mask)


def test_varlen_attention_needs_packing_in_the_config():
    with pytest.raises(ValueError, match="set learner.pack_sequences"):
        make_config({"attention": "varlen", "pack_sequences": False})
    with pytest.raises(ValueError, match="varlen attention needs packed ones"):
        make_config({"attention": "varlen", "share_prefix": True})
    assert make_config({"attention": "varlen", "pack_sequences": True}).learner.attention == "varlen"
    assert levers.resolve(make_config({"attention": "varlen"}), "cpu").learner.pack_sequences is True


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_packed_values_equal_padded(model_dir, attention):
    from services.learner.model import load_value_model, token_values

    critic = load_value_model(model_dir).double()
    packed_critic = load_value_model(model_dir, attention=attention).double()
    for c in (critic, packed_critic):
        torch.nn.init.normal_(c.score.weight, generator=torch.Generator().manual_seed(1))
    ids, mask = _ragged_inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            token_values(packed_critic, ids, mask, pack=True) * mask,
            token_values(critic, ids, mask) * mask,
            rtol=1e-6,
            atol=1e-6,
        )


def test_token_budget_groups_consecutive_rows():
    from services.learner.packing import token_budget_chunks

    assert token_budget_chunks([3, 4, 2, 9, 1, 1], 7) == [[0, 1], [2], [3], [4, 5]]
    assert token_budget_chunks([5], 1) == [[0]]


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_train_step_same_with_packing_and_token_budget(model_dir, advantage, attention):
    """Packed micro-batches formed by a token budget: the same step as padded micro-batches of 3 sequences
    (policy, critic and reference, two epochs, two mini-batches)."""
    trajs = synthetic_trajectories(9, 3, seed=8)
    settings = {
        "advantage": advantage,
        "ppo_epochs": 2,
        "ppo_mini_batch_size": 6,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        **({"lam": 0.9, "critic_lr": 1e-2} if advantage == "gae" else {}),
    }
    padded = PolicyTrainer(make_config({}, **settings), model_dir).train_step(trajs)
    packed_config = make_config({"pack_sequences": True, "attention": attention}, micro_batch_tokens=24, **settings)
    packed_trainer = PolicyTrainer(packed_config, model_dir)
    sizes = [len(m.rows) for mini in packed_trainer._mini_batches(collate(trajs, 0)) for m in mini.micro]
    assert sizes != [3, 3, 3] and max(sizes) > 1  # the budget, not the sequence count, formed them
    packed = packed_trainer.train_step(trajs)
    for key, value in untimed(padded).items():
        assert packed[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_activation_checkpointing_same_gradients_fewer_saved_tensors(model_dir):
    from services.learner.model import load_model
    from services.learner.parallelize import checkpoint_activations, decoder_layers

    plain, ckpt = load_model(model_dir), load_model(model_dir)
    for layer in decoder_layers(ckpt):
        checkpoint_activations(layer)
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    counts = []
    for model in (plain, ckpt):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(1) or t, lambda t: t):
            _stats_and_grads(model, 0)
        counts.append(len(saved))
    assert counts[1] < counts[0] / 2
    lp, ent, grads = _stats_and_grads(plain, 0)
    lp_c, ent_c, grads_c = _stats_and_grads(ckpt, 0)
    torch.testing.assert_close(lp_c, lp, rtol=0, atol=0)
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_train_step_same_with_activation_checkpointing(model_dir):
    trajs = synthetic_trajectories(8, 4, seed=6)
    settings = {"advantage": "gae", "lam": 0.9, "critic_lr": 1e-2, "ppo_epochs": 2}
    runs = []
    for on in (False, True):
        trainer = PolicyTrainer(make_config({"activation_checkpointing": on}, **settings), model_dir)
        runs.append((untimed(trainer.train_step(trajs)), trainer.named_weights_for_push()))
    (plain, plain_w), (ckpt, ckpt_w) = runs
    _assert_same_step(ckpt, ckpt_w, plain, plain_w)


def _assert_same_step(metrics, weights, want_metrics, want_weights):
    """Step metrics and pushed weights equal to float tolerance."""
    assert metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert [n for n, _ in weights] == [n for n, _ in want_weights]
    for (name, a), (_, b) in zip(want_weights, weights):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp_wrap_root_is_one_unit_and_trains_as_per_layer_units(model_dir):
    """`root` (the `auto` choice on one process) wraps the model alone, its layers no FSDP units of their own;
    two steps (GAE: the critic too, then a KL reference), the scoring pass, and the pushed weights agree with
    per-layer units; a no-grad forward between steps leaves the state dict sharded."""
    from torch.distributed.fsdp import FSDPModule

    trajs = [synthetic_trajectories(8, 4, seed=s) for s in (8, 9)]
    settings = {"advantage": "gae", "lam": 0.9, "critic_lr": 1e-2, "ppo_epochs": 2, "use_kl_loss": True}
    runs = []
    for wrap in ("layers", "root", "auto"):
        trainer = PolicyTrainer(make_config({"fsdp_wrap": wrap}, **settings), model_dir)
        per_layer = [isinstance(layer, FSDPModule) for layer in trainer.model.get_decoder().layers]
        assert isinstance(trainer.model, FSDPModule)
        assert per_layer == [wrap == "layers"] * len(per_layer)
        metrics = [untimed(trainer.train_step(t)) for t in trajs]
        with torch.no_grad():  # root's weights stay gathered after a no-grad forward; the state dict reshards
            ids, mask = _inputs()
            token_logprobs(trainer.model, ids, mask)
        assert all(hasattr(t, "full_tensor") for t in trainer.model.state_dict().values())
        runs.append((metrics, trainer.named_weights_for_push()))
    (layers, layers_w), *others = runs
    for metrics, weights in others:
        for got, want in zip(metrics, layers):
            _assert_same_step(got, weights, want, layers_w)


def test_fsdp_wrap_auto_is_root_on_one_process_only(monkeypatch):
    from services.learner import parallelize

    assert parallelize.resolve_wrap("auto") == "root"
    assert parallelize.resolve_wrap("layers") == "layers"
    monkeypatch.setattr(parallelize, "world_size", lambda: 2)
    assert parallelize.resolve_wrap("auto") == "layers"
    assert parallelize.resolve_wrap("root") == "root"
    with pytest.raises(ValueError, match="unknown FSDP wrap"):
        parallelize.resolve_wrap("blocks")


def test_decoder_compile_scope_needs_one_fsdp_unit(model_dir, monkeypatch):
    from services.learner.model import load_model
    from services.learner.parallelize import parallelize

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="needs one FSDP unit"):
        parallelize(load_model(model_dir), cpu, compile_layers=True, compile_scope="decoder", wrap="layers")
    with pytest.raises(ValueError, match="unknown compile scope"):
        parallelize(load_model(model_dir), cpu, compile_layers=True, compile_scope="model")
    # auto is per-layer units on several processes
    monkeypatch.setattr("services.learner.parallelize.world_size", lambda: 2)
    with pytest.raises(ValueError, match="needs one FSDP unit"):
        parallelize(load_model(model_dir), cpu, compile_layers=True, compile_scope="decoder", wrap="auto")


def test_one_mini_batch_is_the_whole_batch(model_dir):
    trajs = synthetic_trajectories(8, 4, seed=7)
    whole = PolicyTrainer(make_config(ppo_epochs=2), model_dir).train_step(trajs)
    for size in (8, 100):
        same = PolicyTrainer(make_config(ppo_epochs=2, ppo_mini_batch_size=size), model_dir).train_step(trajs)
        assert untimed(same) == untimed(whole)


def test_mini_batches_match_a_hand_written_loop(model_dir):
    """2 mini-batches x 2 epochs = 4 optimizer steps, each on its mini-batch's mean loss; the learning-rate
    schedule advances once per learner step (warm-up: every optimizer step of step 0 runs at lr / 4)."""
    from services.learner.advantages import build_estimator
    from services.learner.advantages.base import AdvantageInputs
    from services.learner.batch import collate
    from services.learner.losses import policy_loss
    from services.learner.model import load_model

    trajs = synthetic_trajectories(8, 4, seed=7)
    config = make_config(ppo_epochs=2, ppo_mini_batch_size=4, entropy_coeff=0.0, tis_cap=0.0, lr_warmup_steps=4)
    algo = config.algorithm
    trainer = PolicyTrainer(config, model_dir)
    metrics = trainer.train_step(trajs)
    assert trainer.step == 1 and trainer.scheduler.last_epoch == 1
    assert {int(s["step"]) for s in trainer.optimizer.state.values()} == {4}
    assert metrics["lr"] == pytest.approx(algo.lr / 4)

    model = load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=algo.lr / 4, weight_decay=algo.weight_decay)
    batch = collate(trajs, 0, allocation=config.reward.allocation, gamma=config.reward.gamma)
    with torch.no_grad():
        old = token_logprobs(model, batch.input_ids, batch.attention_mask)
    advantages, _ = build_estimator(algo).advantages_and_returns(
        AdvantageInputs(batch.token_rewards, batch.response_mask, batch.group_index, gamma=algo.gamma, lam=algo.lam)
    )
    for _ in range(2):
        for rows in (slice(0, 4), slice(4, 8)):
            mini = batch.select(rows)
            optimizer.zero_grad()
            logprobs = token_logprobs(model, mini.input_ids, mini.attention_mask)
            loss, _ = policy_loss(
                logprobs,
                old[rows],
                advantages[rows],
                mini.response_mask,
                algo.clip_ratio_low,
                algo.clip_ratio_high,
                algo.loss_agg_mode,
                clip_ratio_c=algo.clip_ratio_c,
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), algo.grad_clip)
            optimizer.step()
    expected = model.state_dict()
    for name, weight in trainer.named_weights_for_push():
        torch.testing.assert_close(weight, expected[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow  # inductor compiles the layer graphs with a C++ compiler: tens of seconds on CPU
def test_train_step_same_with_compiled_layers(model_dir, monkeypatch):
    # every micro-batch has another shape: compiled for dynamic shapes at once, the layer graph is compiled once
    # instead of three times (static, then dynamic in the length, then in the rows), 77 s of a CI run
    monkeypatch.setattr(torch._dynamo.config, "assume_static_by_default", False)
    trajs = synthetic_trajectories(8, 4, seed=8)
    plain = untimed(PolicyTrainer(make_config({"activation_checkpointing": True}), model_dir).train_step(trajs))
    trainer = PolicyTrainer(make_config({"activation_checkpointing": True, "compile": True}), model_dir)
    compiled = untimed(trainer.train_step(trajs))
    assert [n for n, _ in trainer.named_weights_for_push()][:3] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ]
    for key, value in plain.items():
        assert compiled[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_fused_adamw_takes_the_foreach_steps_and_its_checkpoint_resumes_either_way(model_dir, tmp_path):
    batches = [synthetic_trajectories(8, 4, seed=s) for s in (5, 6, 7)]
    foreach = PolicyTrainer(make_config(), model_dir)
    fused = PolicyTrainer(make_config({"fused_optimizer": True}), model_dir)
    assert fused.optimizer.defaults["fused"] and not foreach.optimizer.defaults["fused"]
    for trajs in batches[:2]:
        want, got = untimed(foreach.train_step(trajs)), untimed(fused.train_step(trajs))
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    path = fused.save_checkpoint(tmp_path / "ckpt")
    resumed = PolicyTrainer(make_config(), model_dir)  # foreach from a fused checkpoint
    resumed.load_checkpoint(path)
    want, got = untimed(fused.train_step(batches[2])), untimed(resumed.train_step(batches[2]))
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_one_fsdp_unit_keeps_weights_and_gradient_across_micro_batches(model_dir, monkeypatch):
    """With `root` on one process the weights are freed and the gradient reduced only after a mini-batch's
    last micro-batch (8 trajectories, 3 a micro-batch: 3 backward passes); per-layer units are left alone."""
    from torch.distributed.fsdp import FSDPModule

    calls = []
    for method in ("set_reshard_after_backward", "set_requires_gradient_sync"):
        original = getattr(FSDPModule, method)

        def spy(self, value, *args, _method=method, _original=original, **kwargs):
            calls.append((_method, value))
            return _original(self, value, *args, **kwargs)

        monkeypatch.setattr(FSDPModule, method, spy)
    trajs = synthetic_trajectories(8, 4, seed=3)
    PolicyTrainer(make_config({"fsdp_wrap": "root"}), model_dir).train_step(trajs)
    assert [v for m, v in calls if m == "set_reshard_after_backward"] == [False, False, True]
    assert [v for m, v in calls if m == "set_requires_gradient_sync"] == [False, False, True]
    calls.clear()
    PolicyTrainer(make_config({"fsdp_wrap": "layers"}), model_dir).train_step(trajs)
    assert calls == []
