"""Two FSDP processes (torchrun, gloo) must train exactly like one process on the full batch, also where the
rollout correction rejects tokens (its divisors and metrics are reduced over the ranks)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.learner import untimed
from tests.support.smoke import (
    ALL_AGG_MODES,
    LEVERS_CASE,
    PPO_CASE,
    REJECT_CASE,
    build_tiny_llama,
    case_config,
    run,
    synthetic_trajectories,
)

REPO = Path(__file__).resolve().parents[2]
CASES = ALL_AGG_MODES + [PPO_CASE, LEVERS_CASE, REJECT_CASE]
REJECTION_METRICS = (
    "rollout_is_masked_fraction",
    "rollout_is_seq_masked_fraction",
    "rollout_is_veto_fraction",
    "rollout_is_masked_tokens",
    "rollout_is_masked_seqs",
)


def close(a, b, rel=1e-5, abs_=1e-7):
    return a == pytest.approx(b, rel=rel, abs=abs_)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    model = str(build_tiny_llama(tmp / "model"))
    out = tmp / "two.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "tests.support.smoke",
        "--model",
        model,
        "--out",
        str(out),
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--agg-modes",
        ",".join(CASES),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        one = run(model, agg_modes=CASES)  # the same steps in this process, world of one
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    two = json.loads(out.read_text())
    assert two["world_size"] == 2
    return one, two["results"], tmp, model


@pytest.mark.parametrize("mode", CASES)
def test_the_bucketed_push_set_gathered_over_two_processes_is_the_full_state_dict(results, mode):
    one, two, *_ = results
    assert one[mode]["streamed_push_agrees"] and two[mode]["streamed_push_agrees"]


@pytest.mark.parametrize("mode", CASES)
def test_two_processes_match_one(results, mode):
    one, two, _, _ = results
    assert close(two[mode]["checksum"], one[mode]["checksum"])
    keys = ["loss", "grad_norm", "clip_frac", "approx_kl", "ratio_mean", "mismatch_kl", "entropy"]
    if mode in (PPO_CASE, LEVERS_CASE):  # critic, reference and KL controller: sharded, gathered the same way
        keys += [
            "vf_loss",
            "critic_grad_norm",
            "vf_explained_var",
            "kl_ref",
            "kl_loss",
            "kl_in_reward",
            "kl_coef",
            "entropy_loss",
            "values_mean",
        ]
    if mode == REJECT_CASE:
        keys += ["entropy_loss", "tis_weight_mean", "tis_clip_frac"]
    rel = 1e-4 if mode == LEVERS_CASE else 1e-5  # 3x the optimizer steps: Adam compounds the rounding
    for m1, m2 in zip(one[mode]["metrics"], two[mode]["metrics"], strict=True):
        for key in keys:
            assert close(m2[key], m1[key], rel=rel), (key, m1[key], m2[key])
        for key in ("num_trajectories", "num_tokens", "reward_mean", "policy_version_max"):
            assert m2[key] == m1[key]
    assert one[mode]["metrics"][0]["clip_frac"] > 0  # the second PPO epoch clips: the path is exercised


def test_two_processes_reject_what_one_rejects(results):
    """Each rank rejects sequences of its own share; the divisors that drop them from the loss and the rejected
    shares in the metrics are the whole batch's, so the two processes report (and train, above) as one does."""
    one, two, *_ = results
    for m1, m2 in zip(one[REJECT_CASE]["metrics"], two[REJECT_CASE]["metrics"], strict=True):
        assert {key: m2[key] for key in REJECTION_METRICS} == {key: m1[key] for key in REJECTION_METRICS}
        # some but not all tokens and sequences rejected, by the band and by the veto
        assert 0 < m1["rollout_is_masked_fraction"] < 1 and 0 < m1["rollout_is_seq_masked_fraction"] < 1
        assert 0 < m1["rollout_is_veto_fraction"] < m1["rollout_is_seq_masked_fraction"]


@pytest.mark.parametrize("mode", CASES)
def test_two_process_checkpoint_resume(results, mode):
    _, two, tmp, _ = results
    resume = two[mode]["resume"]
    assert resume["extra"] == {"mode": mode} and resume["version"] == 2 and resume["step"] == 2
    assert untimed(resume["continued"]) == untimed(resume["resumed"])
    assert resume["checksums"][0] == resume["checksums"][1]
    assert (tmp / "ckpt" / mode / "step_00000002" / "COMMITTED").is_file()


@pytest.mark.parametrize("mode", [PPO_CASE, LEVERS_CASE])
def test_sharded_checkpoint_of_two_processes_resumes_in_one(results, mode):
    """The two processes wrote their own shards (the default format); one process reshards them on load and
    takes the same next step as the two did."""
    from services.learner.trainer import PolicyTrainer

    _, two, tmp, model = results
    path = tmp / "ckpt" / mode / "step_00000002"
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == "sharded" and meta["world_size"] == 2
    assert sorted(p.name for p in (path / "shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    trainer = PolicyTrainer(case_config(mode), model)
    assert trainer.load_checkpoint(path) == {"mode": mode} and trainer.step == 2
    resumed = trainer.train_step(synthetic_trajectories(7, 2, seed=2))
    continued = two[mode]["resume"]["continued"]
    for key in ("loss", "grad_norm", "vf_loss", "kl_ref", "entropy"):
        assert close(resumed[key], continued[key], rel=1e-4), (key, resumed[key], continued[key])
