"""Two env-service replicas behind one address in a whole local run (vLLM, reward, learner, Redis, all real
processes); one replica is SIGKILLed mid-run. Training goes on to its last step, the episodes the replica
held are retried on the other one, every trajectory the learner gets is from a complete, real episode,
and the run-wide counters say what was lost.

The replica is frozen (SIGSTOP) before it is killed, and killed only once a call of the running step waits
in its socket: so the kill always lands while the rollout has work on that replica (a kill while no
episode used it would lose nothing, and the counters would rightly stay at zero)."""

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.run_state import RunState
from services.common.trajectory import decode_batch
from services.launcher.local import LocalRun

pytestmark = [pytest.mark.e2e]
STEPS, GROUPS, GROUP_SIZE = 8, 4, 4


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
        port = int(victim.health_address.rsplit(":", 1)[1])
        while not _calls_waiting(port):
            assert thread.is_alive() and time.monotonic() < deadline, "\n".join(lines[-30:])
            time.sleep(0.05)
        # calls alternate between the replicas (round robin): within a few more, one is an episode's
        # Create or Step rather than only a Close, and that episode is lost at the kill
        time.sleep(2.0)
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


def _calls_waiting(port: int) -> bool:
    """True once bytes sent to a server socket on `port` wait unread (its process is stopped)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            local_port, state, rx_queue = int(cols[1].rsplit(":", 1)[1], 16), cols[3], int(cols[4].split(":")[1], 16)
            if local_port == port and state == "01" and rx_queue > 0:  # 01: ESTABLISHED
                return True
    return False


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
