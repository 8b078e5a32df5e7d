"""`python -m services.launcher train` restarts a service that dies, as a Deployment would: the reward service
is SIGKILLed (by its PID, from the run's pids.json) once the first step is done, the learner once the tenth
is; the launcher says why each stopped and restarts it, the learner resumes from its last checkpoint, and the
run completes every step once and exits 0. A tiny run: the tiny model without warm-start, two groups of two a
step. Its steps take 0.1-0.3 s, so there are enough of them that the run still needs each service seconds
after its kill (a step's groups are scored after the step before it, and only the learner makes steps)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from tests.support.processes import alive

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STEPS, KILLS = 30, {1: "reward", 10: "learner"}
"""After the launcher has printed step n, the service that is killed."""


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, redis_url):
    out, run = tmp_path_factory.mktemp("train-restarts"), f"restart-{uuid.uuid4().hex[:8]}"
    run_dir, output = out / run, out / "launcher.out"
    args = [
        *("-m", "services.launcher", "train", "--plain", "--restart-delay-s", "1"),
        *("--run", run, "--output_dir", str(out), "--steps", str(STEPS), "--stream.redis_url", redis_url),
        *("--model.warmstart_steps", "0", "--rollout.group_size", "2", "--rollout.groups_per_step", "2"),
        *("--env.max_turns", "2", "--env.data_dir", str(out / "data"), "--env.train_tasks", "500"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with output.open("wb") as sink:
        launcher = subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    killed, pending = {}, dict(KILLS)
    try:
        deadline = time.monotonic() + 300
        while launcher.poll() is None:
            assert time.monotonic() < deadline, output.read_text()[-3000:]
            step = next(iter(pending), None)
            if step and re.search(rf"^step +{step}/{STEPS} ", output.read_text(), re.M):
                name = pending.pop(step)
                pid = json.loads((run_dir / "pids.json").read_text())[name]
                with contextlib.suppress(ProcessLookupError):  # too late: the run is over (asserted below)
                    os.kill(pid, signal.SIGKILL)
                    killed[name] = pid
            time.sleep(0.05)
        yield {"exit": launcher.returncode, "output": output.read_text(), "killed": killed, "run_dir": run_dir}
    finally:
        if launcher.poll() is None:
            os.kill(launcher.pid, signal.SIGTERM)  # the launcher stops every service it started
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        pids = json.loads((run_dir / "pids.json").read_text()) if (run_dir / "pids.json").exists() else {}
        for pid in pids.values():
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(f"omrl:{run}:*"))
        if keys:
            client.delete(*keys)
        client.close()


def test_the_run_completes_every_step_once_and_exits_0(killed_run):
    assert set(killed_run["killed"]) == set(KILLS.values()), "the run ended before every kill"
    assert killed_run["exit"] == 0, killed_run["output"][-3000:]
    steps = [int(m) for m in re.findall(rf"^step +(\d+)/{STEPS} ", killed_run["output"], re.M)]
    assert steps == list(range(1, STEPS + 1))
    last_restart = max(killed_run["output"].index(f"{name} restarted") for name in KILLS.values())
    assert re.search(rf"^step +{STEPS}/{STEPS} ", killed_run["output"][last_restart:], re.M), "done before a restart"


@pytest.mark.parametrize("name", KILLS.values())
def test_each_restart_and_its_reason_are_shown(killed_run, name):
    output = killed_run["output"]
    assert f"{name} exited (killed by SIGKILL); restarting it in 1s (restart 1 of 3)" in output
    restarted = re.search(rf"^{name} restarted \(pid (\d+), restart 1 of 3\)$", output, re.M)
    assert restarted and int(restarted.group(1)) != killed_run["killed"][name]
    assert json.loads((killed_run["run_dir"] / "pids.json").read_text())[name] == int(restarted.group(1))


def test_the_restarted_learner_resumed_from_its_checkpoint(killed_run):
    log = (killed_run["run_dir"] / "logs" / "learner.log").read_text(errors="replace")
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    killed_after = next(step for step, name in KILLS.items() if name == "learner")
    assert resumed and int(resumed.group(1)) >= killed_after, log[-3000:]
