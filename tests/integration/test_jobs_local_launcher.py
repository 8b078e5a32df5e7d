"""The local launcher's process handling with small stand-in processes: re-attaching after an API
restart, stopping what a dead supervisor left, PID-reuse safety, cancel escalation, and the supervisor's
own signal handling."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from services.jobs import launchers
from services.jobs.spec import JobSpec
from services.launcher.local import LocalLauncher

SLEEPER = "import sys, time; time.sleep(120)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"


@pytest.fixture
def procs():
    started = []

    def spawn(code: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], start_new_session=True)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def job_dir(tmp_path, status: dict | None = None, pids: dict | None = None, log: str = ""):
    run_dir = tmp_path / "job-1"
    (run_dir / "logs").mkdir(parents=True)
    if status is not None:
        (run_dir / "status.json").write_text(json.dumps(status))
    if pids is not None:
        (run_dir / "pids.json").write_text(json.dumps(pids))
    (run_dir / "logs" / "supervisor.log").write_text(log)
    return run_dir


def handle_for(proc: subprocess.Popen, run_dir) -> dict:
    return {
        "run_dir": str(run_dir),
        "pid": proc.pid,
        "create_time": psutil.Process(proc.pid).create_time(),
        "log_offset": 0,
    }


def dead_supervisor(procs, run_dir) -> dict:
    proc = procs(SLEEPER)
    handle = handle_for(proc, run_dir)
    proc.kill()
    proc.wait()
    return handle


def test_a_restarted_api_reattaches_to_a_live_supervisor(tmp_path, procs):
    log = (
        "tiny model ready in 3s\n"
        "Loading weights: 100%|##########| 21/21 [00:00<00:00, 1882.34it/s]\n"
        "step   1/2 | reward +0.057 | success   0.0% | kl 0.0000\n"
        "all services healthy\npartial line without newl"
    )
    run_dir = job_dir(tmp_path, status={"phase": "running"}, log=log)
    supervisor = procs(SLEEPER)
    status = LocalLauncher(tmp_path).recover("job-1", handle_for(supervisor, run_dir))
    assert status.state == launchers.RUNNING
    assert status.messages == [
        f"re-attached to the job's supervisor (pid {supervisor.pid})",
        "tiny model ready in 3s",
        "all services healthy",
    ]
    assert status.handle["log_offset"] == len(log) - len("partial line without newl")


def test_a_supervisor_that_died_with_the_api_leaves_an_interrupted_job_and_no_processes(tmp_path, procs):
    run_dir = tmp_path / "job-1"
    service = procs(SLEEPER, "--config", str(run_dir / "config.yaml"))
    job_dir(tmp_path, status={"phase": "running"}, pids={"rollout": service.pid})
    status = LocalLauncher(tmp_path).recover("job-1", dead_supervisor(procs, run_dir))
    assert status.state == launchers.INTERRUPTED
    assert f"stopped its service processes (rollout (pid {service.pid}))" in status.error
    assert "checkpoints stay in" in status.error
    assert gone(service.pid)


def test_a_job_that_ended_while_the_api_was_down_keeps_its_outcome(tmp_path, procs):
    run_dir = job_dir(tmp_path, status={"phase": "exited", "state": "succeeded", "error": None})
    status = LocalLauncher(tmp_path).recover("job-1", dead_supervisor(procs, run_dir))
    assert status.state == launchers.SUCCEEDED and status.error is None


def test_a_reused_pid_is_neither_trusted_nor_killed(tmp_path, procs):
    stranger = procs(SLEEPER)  # holds the PID the record names, but is another process
    run_dir = job_dir(tmp_path, status={"phase": "running"}, pids={"learner": stranger.pid})
    handle = handle_for(stranger, run_dir) | {"create_time": 12345.0}
    status = LocalLauncher(tmp_path).recover("job-1", handle)
    assert status.state == launchers.INTERRUPTED and "none left" in status.error
    assert stranger.poll() is None  # its cmdline does not name the job's config: left alone


def test_cancel_escalates_to_sigkill_after_the_grace_period(tmp_path, procs):
    run_dir = job_dir(tmp_path, status={"phase": "running"})
    supervisor = procs(STUBBORN)
    time.sleep(0.5)  # let it install its SIGTERM handler
    launcher = LocalLauncher(tmp_path, cancel_grace_s=0.5)
    handle = launcher.cancel("job-1", handle_for(supervisor, run_dir))
    assert launcher.poll("job-1", handle).state == launchers.CANCELLING
    time.sleep(0.6)
    status = launcher.poll("job-1", handle)
    assert status.state == launchers.CANCELLING and any("killed" in m for m in status.messages)
    assert gone(supervisor.pid)
    assert launcher.poll("job-1", handle).state == launchers.CANCELLED


def test_only_one_of_each_service_runs_locally(tmp_path):
    with pytest.raises(launchers.SpecRejected) as info:
        LocalLauncher(tmp_path).check(JobSpec.model_validate({"resources": {"rollout": {"replicas": 2}}}))
    assert info.value.loc == ("resources", "rollout", "replicas")


def test_logs_are_the_tail_of_the_service_log(tmp_path):
    run_dir = job_dir(tmp_path)
    (run_dir / "logs" / "learner.log").write_text("".join(f"line {i}\n" for i in range(1000)))
    text = LocalLauncher(tmp_path).logs("job-1", {"run_dir": str(run_dir)}, "learner", 3)
    assert text == "line 997\nline 998\nline 999"
    assert LocalLauncher(tmp_path).logs("job-1", {"run_dir": str(run_dir)}, "rollout", 3) == ""


SUPERVISE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from services.common.config import TrainConfig
    from services.launcher import supervisor
    supervisor.SupervisedRun.run = lambda self: (self.status.write(phase="running"), time.sleep(60))
    sys.exit(supervisor.supervise(TrainConfig(), Path(sys.argv[1]), int(sys.argv[2]) or None))
""")


@pytest.mark.parametrize("how,state,code", [("sigterm", "cancelled", 0), ("deadline", "failed", 1)])
def test_the_supervisor_turns_a_cancel_or_its_deadline_into_an_outcome(tmp_path, how, state, code):
    status_path = tmp_path / "status.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISE, str(status_path), "2" if how == "deadline" else "0"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while json.loads(status_path.read_text() if status_path.exists() else "{}").get("phase") != "running":
            assert time.monotonic() < deadline, "the supervisor never reported running"
            time.sleep(0.1)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    status = json.loads(status_path.read_text())
    assert status["phase"] == "exited" and status["state"] == state
    if how == "deadline":
        assert status["error"] == "max_runtime_s (2s) exceeded"


def test_starting_a_job_whose_supervisor_already_runs_adopts_it(tmp_path, procs):
    launcher = LocalLauncher(tmp_path)
    run_dir = tmp_path / "job-1"
    run_dir.mkdir()
    supervisor = procs(SLEEPER, "--config", str(run_dir / "job.yaml"))
    (run_dir / "status.json").write_text(json.dumps({"pid": supervisor.pid, "phase": "starting"}))
    handle = launcher.start("job-1", JobSpec())  # the API died before it recorded the first start
    assert handle["pid"] == supervisor.pid and not (run_dir / "job.yaml").exists()
    assert launcher.poll("job-1", handle).state == launchers.STARTING


def test_a_failed_job_says_why_once_in_one_line_and_keeps_the_detail_in_its_log(tmp_path, monkeypatch, capsys):
    """The status (the job's `error`, shown by `omrl follow/status`) gets one line with the cause; the service's
    log tail goes to the supervisor log for `omrl logs` and is not repeated as event messages."""
    from services.common.config import TrainConfig
    from services.launcher import supervisor

    tail = 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nValueError: bad batch'

    def fail(self):
        print("learner building the model", flush=True)
        raise RuntimeError(f"learner exited with 1:\n{tail}")

    monkeypatch.setattr(supervisor, "_install_stop_handlers", lambda *_: None)
    monkeypatch.setattr(supervisor.SupervisedRun, "run", fail)
    status_path = tmp_path / "status.json"
    assert supervisor.supervise(TrainConfig(), status_path) == 1
    status = json.loads(status_path.read_text())
    assert status["state"] == "failed" and status["error"] == "learner exited with 1: ValueError: bad batch"

    run_dir = job_dir(tmp_path)
    log = capsys.readouterr().out
    (run_dir / "logs" / "supervisor.log").write_text(log)
    assert "ValueError: bad batch" in log and 'File "x.py"' in log, "the detail stays in the log"
    messages = LocalLauncher(tmp_path)._new_log_lines({"run_dir": str(run_dir)})
    assert messages == ["learner building the model"]
