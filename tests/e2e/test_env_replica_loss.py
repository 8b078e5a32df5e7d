"""Two env-service replicas behind one address in a whole local run (vLLM, reward, learner, Redis, all real
processes); one replica is SIGKILLed mid-run. Training goes on to its last step, the episodes the replica
held are retried on the other one, every trajectory the learner gets is from a complete, real episode,
and the run-wide counters say what was lost.

The replica is frozen (SIGSTOP) before it is killed, and killed only once the rollout has an episode's
create or step call in flight that has not moved for a few seconds (the other replica answers in
milliseconds, so such a call waits on the frozen one): the kill always lands while the rollout has an
episode on that replica. A kill while the rollout waits on the learner, or holds only the frozen
replica's Close calls, would lose nothing, and the counters would rightly stay at zero."""

import os
import signal
import threading
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.config import load_config
from services.common.run_state import RunState
from services.common.trajectory import decode_batch
from services.launcher.local import LocalRun

pytestmark = [pytest.mark.e2e]
STEPS, GROUPS, GROUP_SIZE = 8, 4, 4
STUCK_S = 3.0
"""How long an env call must stand still before it counts as waiting on the frozen replica."""


@pytest.fixture(scope="module")
def outcome(tmp_path_factory, redis_url, warm_tiny_model):
    tmp = tmp_path_factory.mktemp("replica-loss")
    config = load_config(
        None,
        [
            "env.name=corridor",
            "env.replicas=2",
            f"env.data_dir={tmp / 'data'}",
            "env.train_tasks=500",
            f"learner.steps={STEPS}",
            f"rollout.group_size={GROUP_SIZE}",
            f"rollout.groups_per_step={GROUPS}",
            f"model.path={warm_tiny_model}",
            f"stream.redis_url={redis_url}",
            f"output_dir={tmp}",
            f"run=replica-loss-{uuid.uuid4().hex[:6]}",
        ],
    )
    lines: list[str] = []
    run = LocalRun(config, say=lines.append)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(run=run.run()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 600
        while not any(line.startswith("step   2/") for line in lines):
            assert thread.is_alive() and time.monotonic() < deadline, "\n".join(lines[-30:])
            time.sleep(0.2)
        victim = next(p for p in run.processes if p.name == "envs-1")
        os.kill(victim.pid, signal.SIGSTOP)
        metrics_url = f"http://127.0.0.1:{run.metrics_ports['rollout']}/metrics"
        stuck_since, last = None, None
        while stuck_since is None or time.monotonic() - stuck_since < STUCK_S:
            assert thread.is_alive() and time.monotonic() < deadline, "\n".join(lines[-30:])
            in_flight, done = _episode_env_calls(metrics_url)
            if in_flight == 0 or done != last:
                stuck_since, last = (time.monotonic() if in_flight else None), done
            time.sleep(0.25)
        os.killpg(victim.pid, signal.SIGKILL)  # its own session: the replica and nothing else
        thread.join(600)
        assert not thread.is_alive() and "run" in result, "\n".join(lines[-30:])
        state = RunState.connect(config)
        counters = state.rollout_counters()
        published = [
            decode_batch(fields[b"batch"]).trajectories for _, fields in state.client.xrange(state.trajectories_key)
        ]
        yield result["run"], lines, counters, published
    finally:
        if thread.is_alive():
            run.stop()
        RunState.connect(config).reset()


def _episode_env_calls(metrics_url: str) -> tuple[float, float]:
    """The rollout's env create and step calls in flight, and how many have finished."""
    text = httpx.get(metrics_url, timeout=5).text
    in_flight = done = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("stage") not in ("env_create", "env_step"):
                continue
            if sample.name == "omrl_rollout_loop_stage_in_flight":
                in_flight += sample.value
            elif sample.name == "omrl_rollout_loop_stage_seconds_count":
                done += sample.value
    return in_flight, done


def test_training_goes_on_to_the_last_step(outcome):
    result, lines, _, _ = outcome
    assert [m["step"] for m in result.history] == list(range(1, STEPS + 1))
    assert any(line.startswith("envs-1 exited with -9; going on with 1 env replica(s)") for line in lines), lines


def test_the_lost_episodes_were_retried_and_counted(outcome):
    _, lines, counters, _ = outcome
    print("rollout counters:", counters)
    assert counters.get("episodes_failed", 0) >= 1 and counters.get("episode_retries", 0) >= 1, counters
    assert any(line.startswith("infrastructure failures (never scored):") for line in lines)


def test_the_learner_got_only_complete_real_episodes(outcome):
    result, _, _, published = outcome
    assert all(m["num_trajectories"] == GROUPS * GROUP_SIZE for m in result.history)
    assert all(len(group) == GROUP_SIZE for group in published)
    trajectories = [t for group in published for t in group]
    assert {t.stop_reason for t in trajectories} <= {"done", "max_turns", "max_length"}
    assert all(len(t.turns) >= 1 and t.reward_components for t in trajectories)
