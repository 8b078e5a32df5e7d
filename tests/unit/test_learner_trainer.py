import json
from functools import partial

import pytest
import torch

from services.learner import collectives, full_weights
from services.learner.checkpoint import COMMITTED, checkpoint_path, latest_checkpoint
from services.learner.model import token_logprobs
from services.learner.trainer import PolicyTrainer
from tests.support.learner import BAD, GOOD, PROMPT, good_bad_batch, logprob_of, untimed
from tests.support.learner import make_config as learner_config
from tests.support.smoke import build_tiny_llama, synthetic_trajectories

make_config = partial(learner_config, entropy_coeff=0.0)
"""The shared learner config without its entropy bonus: these tests train on the policy loss alone."""


def full_params(trainer):
    return {k: v.full_tensor().clone() for k, v in trainer.model.state_dict().items()}


def optim_state(trainer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def test_positive_advantage_tokens_gain_probability(model_dir):
    trainer = PolicyTrainer(make_config(), model_dir)
    batch = good_bad_batch()
    good0, bad0 = logprob_of(trainer, GOOD), logprob_of(trainer, BAD)
    for _ in range(5):
        metrics = trainer.train_step(batch)
    assert logprob_of(trainer, GOOD) > good0 + 0.5
    assert logprob_of(trainer, BAD) < bad0 - 0.5
    assert metrics["num_trajectories"] == 12 and metrics["reward_mean"] == 0.5 and metrics["success_rate"] == 0.5
    assert metrics["response_len_mean"] == 2 and metrics["grad_norm"] > 0 and metrics["entropy"] > 0


def test_mismatch_kl_is_zero_when_rollout_used_the_same_weights(model_dir):
    trainer = PolicyTrainer(make_config(), model_dir)
    trajs = synthetic_trajectories(5, 4, seed=3)
    for traj in trajs:  # score each sampled token from its own prefix, as a sampler does
        ids = list(traj.token_ids)
        for i, m in enumerate(traj.loss_mask):
            if m:
                traj.logprobs[i] = logprob_of_prefix(trainer, ids[:i], ids[i])
    metrics = trainer.train_step(trajs)
    assert metrics["mismatch_kl"] < 1e-8
    assert metrics["ratio_mean"] == pytest.approx(1.0) and metrics["clip_frac"] == 0
    assert metrics["policy_version_min"] == 0 and metrics["policy_version_max"] == 2


def logprob_of_prefix(trainer, prefix, token):
    ids = torch.tensor([prefix])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return torch.log_softmax(logits[0, -1].float(), -1)[token].item()


def test_checkpoint_round_trip_is_bit_identical(model_dir, tmp_path):
    config = make_config(ppo_epochs=2)
    trainer = PolicyTrainer(config, model_dir)
    for seed in range(2):
        trainer.train_step(synthetic_trajectories(6, 4, seed=seed))
    trainer.policy_version = 7
    path = trainer.save_checkpoint(tmp_path, {"stream_id": "1-0"})
    assert path == checkpoint_path(tmp_path, 2) and (path / COMMITTED).is_file()
    assert PolicyTrainer.latest_checkpoint(tmp_path) == path

    fresh = PolicyTrainer(config, model_dir)
    assert fresh.load_checkpoint(path) == {"stream_id": "1-0"}
    assert (fresh.step, fresh.policy_version) == (2, 7)
    a, b = full_params(trainer), full_params(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = optim_state(trainer), optim_state(fresh)
    betas_as_tuple = [{**g, "betas": tuple(g["betas"])} for g in ob["param_groups"]]  # broadcast makes a list
    assert oa["param_groups"] == betas_as_tuple
    assert oa["state"].keys() == ob["state"].keys()
    for name, state in oa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, ob["state"][name][key]), (name, key)
    nxt = synthetic_trajectories(6, 4, seed=9)
    assert untimed(trainer.train_step(nxt)) == untimed(fresh.train_step(nxt))


def test_pushed_weights_are_the_full_hf_state_dict(model_dir):
    from transformers import AutoModelForCausalLM

    trainer = PolicyTrainer(make_config(), model_dir)
    trainer.train_step(synthetic_trajectories(4, 4, seed=1))
    pushed = trainer.named_weights_for_push()
    params = full_params(trainer)
    assert [n for n, _ in pushed] == list(params)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 and torch.equal(t, params[n]) for n, t in pushed)
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    hf.load_state_dict(dict(pushed), strict=True)  # names as Hugging Face expects
    ids = torch.tensor([PROMPT + [GOOD]])
    with torch.no_grad():
        torch.testing.assert_close(
            token_logprobs(hf.eval(), ids, torch.ones_like(ids)),
            token_logprobs(trainer.model, ids, torch.ones_like(ids)),
        )


def test_the_streamed_push_set_is_the_full_state_dict_bucket_by_bucket(model_dir):
    from services.weightsync.wire import checksum

    config = make_config()
    config.model.dtype = "bfloat16"
    trainer = PolicyTrainer(config, model_dir)
    full = trainer.named_weights_for_push()
    weights = trainer.weight_set_for_push()
    assert [s.name for s in weights.specs] == [n for n, _ in full]
    buckets = list(weights.buckets(bucket_bytes=4096))
    assert len(buckets) > 3 and max(b.nbytes for b in buckets if len(b.specs) > 1) <= 4096
    assert weights.checksum == checksum(full)


def test_a_one_process_mesh_pushes_its_local_tensors_found_once_without_to_local(model_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from services.learner.full_weights import _local_views

    trainer = PolicyTrainer(make_config(), model_dir)
    sharded = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=False))
    local = _local_views(sharded)
    assert list(local) == list(sharded) and all(hasattr(t, "full_tensor") for t in sharded.values())
    for name, t in sharded.items():
        whole = t.to_local() if hasattr(t, "to_local") else t
        assert local[name].data_ptr() == whole.data_ptr() and local[name].shape == t.shape


def test_a_fp32_model_sent_as_bf16_yields_stored_tensors_packed_once_and_again_after_a_step(model_dir):
    from services.weightsync.nccl.pack import BucketPacker
    from services.weightsync.wire import checksum

    trainer = PolicyTrainer(make_config(), model_dir)
    packer = BucketPacker(4096, "cpu")

    def push():
        weights = full_weights.streamed_weights(trainer.model, torch.bfloat16)
        assert {s.dtype for s in weights.specs} == {"bfloat16"}
        assert {t.dtype for _, t in weights.named_tensors()} == {torch.float32}  # cast where packed
        stable = weights.stable_tensors()
        assert stable is not None and len(stable) == len(weights.specs)
        sent = [(n, t.to(torch.bfloat16)) for n, t in full_weights.full_state_dict(trainer.model).items()]
        packed = [(b.data.numpy().tobytes(), b.digest) for b in packer.buckets(weights)]  # two slots, in turn
        assert b"".join(data for data, _ in packed) == b"".join(
            t.reshape(-1).view(torch.uint8).numpy().tobytes() for _, t in sent
        )
        list(weights.buckets(4096))  # the host path casts too
        assert weights.checksum == checksum(sent)
        return packed[0][1]

    before = push()
    trainer.train_step(synthetic_trajectories(4, 4, seed=1))  # in-place optimizer step: the layout stays
    assert push() != before and packer.builds == 1


def test_pushed_weights_in_configured_dtype(model_dir):
    config = make_config()
    config.model.dtype = "bfloat16"
    trainer = PolicyTrainer(config, model_dir)
    assert {t.dtype for _, t in trainer.named_weights_for_push()} == {torch.bfloat16}


def test_background_checkpoint_holds_the_weights_of_its_step_and_commits_last(model_dir, tmp_path):
    config = make_config()
    config.learner.checkpoint_async = True
    trainer = PolicyTrainer(config, model_dir)
    trainer.train_step(synthetic_trajectories(6, 4, seed=0))
    at_save = {k: v.clone() for k, v in full_params(trainer).items()}
    pending = trainer.start_checkpoint(tmp_path, {"step": 1}, background=True)
    trainer.train_step(synthetic_trajectories(6, 4, seed=1))  # trains on while the shards are written
    assert latest_checkpoint(tmp_path) is None  # nothing counts before the commit
    path = pending.commit()
    assert pending.commit() == path == latest_checkpoint(tmp_path)  # committing twice is harmless
    fresh = PolicyTrainer(config, model_dir)
    assert fresh.load_checkpoint(path) == {"step": 1}
    loaded = full_params(fresh)
    assert all(torch.equal(loaded[k], at_save[k]) for k in at_save)
    assert not all(torch.equal(full_params(trainer)[k], at_save[k]) for k in at_save)


def test_latest_checkpoint_ignores_unfinished_and_keeps_last_k(model_dir, tmp_path):
    config = make_config()
    config.learner.keep_checkpoints = 2
    trainer = PolicyTrainer(config, model_dir)
    for step in (1, 2, 3):
        trainer.step = trainer.policy_version = step
        trainer.save_checkpoint(tmp_path, {"step": step})
    trainer.save_checkpoint(tmp_path, {"step": 3, "again": True})  # the same step saved twice: the last wins
    # a crash mid-write: a temp dir, and a renamed dir whose marker never landed
    (tmp_path / "step_00000005.tmp").mkdir()
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "model.pt").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir() if (p / COMMITTED).exists()) == ["step_00000002", "step_00000003"]
    assert json.loads((checkpoint_path(tmp_path, 3) / "meta.json").read_text())["extra"] == {"step": 3, "again": True}
    assert not list(tmp_path.glob("*.old"))
    assert latest_checkpoint(tmp_path / "missing") is None
    with pytest.raises(FileNotFoundError):
        trainer.load_checkpoint(tmp_path / "step_00000004")


def test_world_of_one_is_idempotent():
    assert collectives.init_distributed("cpu") == (0, 1) == collectives.init_distributed("cpu")
    assert collectives.is_rank0() and collectives.broadcast_object({"a": 1}) == {"a": 1}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batching_equals_full_batch(model_dir, mode):
    trajs = synthetic_trajectories(7, 4, seed=5)
    runs = []
    for size in (1, 3, 64):
        trainer = PolicyTrainer(make_config(loss_agg_mode=mode, micro_batch_size=size, ppo_epochs=2), model_dir)
        runs.append((trainer.train_step(trajs), full_params(trainer)))
    (m_full, p_full) = runs[-1]
    for metrics, params in runs[:-1]:
        for key in ("loss", "grad_norm", "clip_frac", "approx_kl", "entropy", "mismatch_kl"):
            assert metrics[key] == pytest.approx(m_full[key], rel=1e-5, abs=1e-7), key
        for name, value in params.items():
            # Adam magnifies fp noise: its second step divides moments of two gradients that may nearly cancel
            # (1e-4 is 1.7% of the largest update, 2 x lr; a wrong split moves the metrics above at 1e-5)
            torch.testing.assert_close(value, p_full[name], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tie", [False, True])
def test_export_is_a_hugging_face_model_with_the_trained_weights(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    from services.learner.hf_export import main as export_main

    base = str(build_tiny_llama(tmp_path / "base", tie=tie))
    trainer = PolicyTrainer(make_config(), base)
    trainer.train_step(synthetic_trajectories(6, 4, seed=0))
    out = trainer.export_hf(tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        assert torch.allclose(exported(input_ids=ids).logits, want, atol=1e-6)
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits, want, atol=1e-3)

    path = trainer.save_checkpoint(tmp_path / "ckpt")  # the same weights, exported offline from the shards
    export_main(["--checkpoint", str(path), "--base", base, "--out", str(tmp_path / "offline"), "--dtype", "float32"])
    offline = AutoModelForCausalLM.from_pretrained(tmp_path / "offline")
    a, b = exported.state_dict(), offline.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_auto_checkpoint_format_shards_only_where_it_helps(model_dir, tmp_path):
    """One process: whole state dicts (shards only add overhead); asynchronous saves need shards. Several
    processes take shards (tests/integration/test_fsdp_two_procs.py)."""
    config = make_config()
    assert config.learner.checkpoint_format == "auto"
    trainer = PolicyTrainer(config, model_dir)
    assert trainer.checkpoint_format == "full"
    path = trainer.save_checkpoint(tmp_path)
    assert json.loads((path / "meta.json").read_text())["format"] == "full"
    trainer.config.learner.checkpoint_async = True  # the trainer's own copy, its `auto` levers resolved
    assert trainer.checkpoint_format == "sharded"
