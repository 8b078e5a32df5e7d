"""Exact resume of the learner process: N steps straight versus N/2 steps, SIGKILL mid-step, restart, on
the same recorded trajectory batches (written once to a file, replayed into each run's Redis stream).
Critic, reference KL (in the reward, adaptive, and as a loss), entropy bonus, warm-up + cosine schedule
and truncated IS are all on, so every piece of checkpointed state takes part."""

import json
import os
import signal
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis
import torch

from services.common.config import dump_config, load_config
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.common.trajectory import decode_batch, encode_batch
from services.launcher.processes import ServiceProcess, python_module
from services.learner.checkpoint import checkpoint_path, full_model_state
from tests.support.smoke import build_tiny_llama, synthetic_trajectories

pytestmark = [pytest.mark.e2e]
STEPS, GROUPS, GROUP_SIZE = 6, 3, 4
LOSS_KEYS = (
    "loss",
    "pg_loss",
    "vf_loss",
    "kl_loss",
    "entropy_loss",
    "kl_in_reward",
    "kl_coef",
    "grad_norm",
    "critic_grad_norm",
    "approx_kl",
    "clip_frac",
    "mismatch_kl",
    "tis_weight_mean",
    "lr",
    "critic_lr",
)


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """The recorded batches: one stream entry per group, as a rollout server writes them."""
    root = tmp_path_factory.mktemp("resume")
    model = build_tiny_llama(root / "model")
    path = root / "batches.bin"
    batches = []
    for step in range(STEPS):
        trajs = synthetic_trajectories(GROUPS * GROUP_SIZE, GROUP_SIZE, seed=100 + step)
        for g in range(GROUPS):
            members = trajs[g * GROUP_SIZE : (g + 1) * GROUP_SIZE]
            for t in members:
                t.group_id = f"s{step}g{g}"
                for turn in t.turns:  # sampled by policy `step`, as a synchronous rollout would
                    turn.policy_version = step
            batches.append(encode_batch(members, f"s{step}g{g}"))
    path.write_bytes(b"".join(len(b).to_bytes(4, "big") + b for b in batches))
    return root, str(model), path


def replay(path: Path, stream: TrajectoryStream) -> list[str]:
    data, ids, at = path.read_bytes(), [], 0
    while at < len(data):
        n = int.from_bytes(data[at : at + 4], "big")
        ids.append(stream.publish(decode_batch(data[at + 4 : at + 4 + n]).trajectories))
        at += 4 + n
    return ids


def start_run(root: Path, model: str, recording: Path, redis_url: str, name: str):
    config = load_config(
        None,
        [
            f"run={name}",
            "seed=7",
            f"model.path={model}",
            f"stream.redis_url={redis_url}",
            "stream.read_block_ms=200",
            f"rollout.groups_per_step={GROUPS}",
            f"rollout.group_size={GROUP_SIZE}",
            f"learner.steps={STEPS}",
            f"learner.checkpoint_dir={root / name / 'ckpt'}",
            "learner.device=cpu",
            "learner.weight_push=none",
            "learner.keep_checkpoints=2",
            "learner.step_timeout_s=120",
            "algorithm.advantage=gae",
            "algorithm.lam=0.95",
            "algorithm.gamma=0.99",
            "algorithm.critic_lr=5e-3",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_ctrl=adaptive",
            "algorithm.kl_coef=0.05",
            "algorithm.kl_target=0.001",
            "algorithm.kl_horizon=100",
            "algorithm.use_kl_loss=true",
            "algorithm.kl_loss_coef=0.1",
            "algorithm.entropy_coeff=0.01",
            "algorithm.lr=5e-3",
            "algorithm.lr_warmup_steps=2",
            "algorithm.lr_schedule=cosine",
            "algorithm.ppo_epochs=2",
            "algorithm.micro_batch_size=5",
            "algorithm.tis_cap=2.0",
        ],
    )
    (root / name).mkdir(parents=True)
    config_path = root / name / "config.yaml"
    config_path.write_text(dump_config(config))
    state = RunState.connect(config)
    state.reset()
    stream = TrajectoryStream(state.client, state.trajectories_key)
    ids = replay(recording, stream)
    return config, config_path, state, stream, ids


def learner_process(config_path: Path, log: Path) -> ServiceProcess:
    proc = ServiceProcess(
        "learner", python_module("services.learner", "--config", str(config_path)), log, env={"OMP_NUM_THREADS": "1"}
    )
    return proc.start()


def wait_exit(proc: ServiceProcess, timeout_s: float = 300) -> int:
    try:
        return proc.popen.wait(timeout=timeout_s)
    except Exception:
        proc.stop()
        raise


def summaries(state: RunState) -> list[dict]:
    return [m for _, m in state.read_metrics()]


def group_info(state: RunState, stream: TrajectoryStream) -> dict:
    info = [g for g in state.client.xinfo_groups(stream.key) if g["name"] in (b"learner", "learner")][0]
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in info.items()}


@pytest.fixture(scope="module")
def runs(recording, tmp_path_factory):
    root, model, path = recording
    work = tmp_path_factory.mktemp("runs")
    url = os.environ.get("OMRL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    redis.Redis.from_url(url, socket_timeout=2).ping()
    tag = uuid.uuid4().hex[:6]
    out = {}
    cleanup = []
    try:
        # straight through
        cfg_a, path_a, state_a, stream_a, ids_a = start_run(work, model, path, url, f"resume-straight-{tag}")
        cleanup.append(state_a)
        proc = learner_process(path_a, work / "straight.log")
        assert wait_exit(proc) == 0, proc.log_tail()
        out["straight"] = (cfg_a, state_a, stream_a, ids_a, summaries(state_a))

        # killed after half the steps, while the next step is being trained, then restarted
        cfg_b, path_b, state_b, stream_b, ids_b = start_run(work, model, path, url, f"resume-killed-{tag}")
        cleanup.append(state_b)
        proc = learner_process(path_b, work / "killed.log")
        deadline = time.monotonic() + 300
        while not any(m["step"] == STEPS // 2 for m in summaries(state_b)):
            assert proc.running() and time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.02)
        while stream_b.pending_count() == 0:  # the learner has read step N/2 + 1's batches: mid-step
            assert proc.running() and time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.popen.wait(timeout=30) == -signal.SIGKILL
        at_kill = {"pending": stream_b.pending_count(), "steps": [m["step"] for m in summaries(state_b)]}
        restarted = learner_process(path_b, work / "restarted.log")
        assert wait_exit(restarted) == 0, restarted.log_tail()
        out["killed"] = (cfg_b, state_b, stream_b, ids_b, summaries(state_b))
        out["at_kill"] = at_kill
        out["restart_log"] = (work / "restarted.log").read_text()
        yield out
    finally:
        for state in cleanup:
            state.reset()


def test_the_kill_landed_mid_step(runs):
    at_kill = runs["at_kill"]
    assert at_kill["steps"] == list(range(1, STEPS // 2 + 1))
    assert 0 < at_kill["pending"] <= GROUPS  # read but not acknowledged: trained again after the restart
    assert "resumed from" in runs["restart_log"] and f"at step {STEPS // 2}" in runs["restart_log"]
    assert "pending stream entries will be trained on again" in runs["restart_log"]


def test_per_step_losses_match_the_straight_run(runs):
    straight, killed = runs["straight"][4], runs["killed"][4]
    assert [m["step"] for m in straight] == [m["step"] for m in killed] == list(range(1, STEPS + 1))
    for a, b in zip(straight, killed):
        for key in LOSS_KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-9), (a["step"], key, a[key], b[key])
    assert straight[-1]["kl_coef"] != straight[0]["kl_coef"]  # the adaptive controller moved: its state mattered
    assert straight[0]["lr"] < straight[1]["lr"] and straight[-1]["lr"] < straight[2]["lr"]  # warm-up, cosine


def test_final_weights_match(runs):
    states = []
    for name in ("straight", "killed"):
        config = runs[name][0]
        ckpt = checkpoint_path(config.learner.checkpoint_dir, STEPS)
        states.append({part: full_model_state(ckpt, part) for part in ("policy", "critic")})
        assert json.loads((ckpt / "meta.json").read_text())["reference"]["checksum"]
    for part in ("policy", "critic"):
        assert states[0][part].keys() == states[1][part].keys()
        for name, value in states[0][part].items():
            torch.testing.assert_close(states[1][part][name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["straight", "killed"])
def test_every_batch_applied_exactly_once(runs, name):
    config, state, stream, ids, history = runs[name]
    applied = Counter(entry for m in history for entry in m["entry_ids"])
    assert sorted(applied) == sorted(ids) and set(applied.values()) == {1}  # each batch in exactly one step
    info = group_info(state, stream)
    assert info["pending"] == 0 and stream.pending_count() == 0
    last = info["last-delivered-id"]
    assert (last.decode() if isinstance(last, bytes) else last) == ids[-1]
    assert info["entries-read"] == len(ids)  # no entry was handed out as new twice
