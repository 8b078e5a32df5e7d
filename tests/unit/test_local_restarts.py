"""A local run restarts a service that exits, up to a bound, as Kubernetes restarts a pod: driven here with
small stand-in processes (a service that always exits 3, a learner that fails once) and no Redis. Each
restart is a stage event with its reason; past the bound the run fails naming the service and its exit codes."""

import io
import os
import signal
import sys
import time

import pytest
import redis

from services.common.config import load_config
from services.common.config_cli import UsageError
from services.jobs.app import build_launcher
from services.jobs.settings import JobsSettings
from services.launcher import local
from services.launcher.__main__ import build_parser
from services.launcher.local import LocalRun
from services.launcher.processes import ServiceProcess
from services.launcher.report import failure_summary
from services.launcher.restarts import MAX_RESTARTS, RESTART_DELAY_S, exit_reason

EXITS_3 = "import sys; sys.exit(3)"
SLEEPS = "import time; time.sleep(120)"
FAILS_ONCE = "import os, sys; tried = os.path.exists('tried'); open('tried', 'w').close(); sys.exit(0 if tried else 1)"


class NoMetrics:
    """The run's Redis state, with no step ever recorded."""

    def read_metrics(self, last_id, block_ms=0):
        time.sleep(0.02)
        return []

    def rollout_counters(self):
        return {}

    def failure(self):
        return None


class FailedRun(NoMetrics):
    """The learner marked the run failed (`RunState.mark_failed`); or, with `error`, Redis cannot say."""

    def __init__(self, error=None):
        self.error, self.reads = error, 0

    def failure(self):
        self.reads += 1
        if self.error:
            raise self.error
        return {"reason": "step 3: dynamic sampling dropped 24 groups", "config": "0123abcd"}


class Recorder:
    def __init__(self):
        self.stages, self.lines = [], []

    def say(self, line):
        self.lines.append(line)

    def stage(self, record):
        self.stages.append(record)

    def step(self, metrics, total):
        pass


@pytest.fixture
def make_run(tmp_path, monkeypatch):
    monkeypatch.setattr(local.RunState, "connect", classmethod(lambda cls, config: NoMetrics()))
    monkeypatch.chdir(tmp_path)
    runs = []

    def make(services: dict[str, str], overrides: tuple[str, ...] = (), **kwargs) -> LocalRun:
        config = load_config(None, [f"output_dir={tmp_path}", "run=restarts", *overrides])
        config.run_dir.mkdir(parents=True, exist_ok=True)
        view = Recorder()
        run = LocalRun(config, say=view.say, view=view, **kwargs)
        run.processes = [
            ServiceProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log").start()
            for name, code in services.items()
        ]
        runs.append(run)
        return run

    yield make
    for run in runs:
        for proc in run.processes:
            if proc.running():
                os.killpg(proc.pid, signal.SIGKILL)
            proc.popen.wait()


def test_a_service_that_keeps_exiting_fails_the_run_after_its_restarts(make_run):
    run = make_run({"reward": EXITS_3, "learner": SLEEPS}, restart_delay_s=0.0, max_restarts=2)
    with pytest.raises(RuntimeError) as failed:
        run.follow()
    assert failure_summary(failed.value) == (
        "reward exited with 3 after 2 restart(s) (exit codes 3, 3, 3; at most 2 restarts)"
    )
    assert run.restarts == {"reward": 2} and run.exit_codes == {"reward": [3, 3, 3]}
    assert [(s["service"], s["stage"], s["message"].split(" (pid")[0]) for s in run.view.stages] == [
        ("reward", "restarting", "reward exited (exit code 3); restarting it in 0s (restart 1 of 2)"),
        ("reward", "restarted", "reward restarted"),
        ("reward", "restarting", "reward exited (exit code 3); restarting it in 0s (restart 2 of 2)"),
        ("reward", "restarted", "reward restarted"),
    ]
    assert run.view.stages[0]["exit_code"] == 3 and run.view.stages[0]["max_restarts"] == 2


def test_a_learner_that_fails_is_restarted_and_its_success_ends_the_run(make_run):
    run = make_run({"reward": SLEEPS, "learner": FAILS_ONCE}, restart_delay_s=0.0)
    assert run.follow() == []
    assert run.restarts == {"learner": 1} and run.exit_codes == {"learner": [1]}
    assert run.view.stages[0]["message"] == (
        f"learner exited (exit code 1); restarting it in 0s (restart 1 of {MAX_RESTARTS})"
    )


EXITS_1 = "import sys; sys.exit(1)"


def test_a_learner_that_marked_the_run_failed_is_not_restarted(make_run, monkeypatch):
    run = make_run({"reward": SLEEPS, "learner": EXITS_1}, restart_delay_s=0.0)
    state = FailedRun()
    monkeypatch.setattr(local.RunState, "connect", classmethod(lambda cls, config: state))
    with pytest.raises(RuntimeError) as failed:
        run.follow()
    assert failure_summary(failed.value) == (
        "learner exited with 1, not restarted (on the same config it would fail the same way): step 3: dynamic "
        "sampling dropped 24 groups"
    )
    assert run.restarts == {} and run.view.stages == [] and state.reads == 1  # read once, then remembered


def test_a_learner_whose_run_state_cannot_be_read_is_restarted_as_before(make_run, monkeypatch):
    run = make_run({"reward": SLEEPS, "learner": FAILS_ONCE}, restart_delay_s=0.0)
    state = FailedRun(error=redis.ConnectionError("Redis is restarting"))
    monkeypatch.setattr(local.RunState, "connect", classmethod(lambda cls, config: state))
    assert run.follow() == [] and run.restarts == {"learner": 1} and state.reads >= 1


def test_the_restart_waits_its_delay(make_run):
    run = make_run({"reward": EXITS_3, "learner": SLEEPS}, restart_delay_s=1.0, max_restarts=1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reward exited with 3 after 1 restart\(s\)"):
        run.follow()
    assert time.monotonic() - start >= 1.0


def test_an_env_replica_out_of_restarts_is_lost_while_another_serves(make_run):
    services = {"envs": SLEEPS, "envs-1": EXITS_3, "reward": SLEEPS, "learner": "import time; time.sleep(2)"}
    run = make_run(services, ("env.replicas=2",), restart_delay_s=0.0, max_restarts=1)
    assert run.follow() == []
    assert run.restarts == {"envs-1": 1} and [p.name for p in run.lost_replicas] == ["envs-1"]
    assert "envs-1 exited with 3; going on with 1 env replica(s)" in run.view.lines


@pytest.mark.parametrize("kwargs", [{}, {"restart_delay_s": 0.0, "max_restarts": 0}], ids=["off", "no-restarts-left"])
def test_without_restarts_the_first_exit_fails_the_run_as_before(make_run, kwargs):
    run = make_run({"reward": EXITS_3, "learner": SLEEPS}, **kwargs)
    with pytest.raises(RuntimeError) as failed:
        run.follow()
    assert failure_summary(failed.value) == "reward exited with 3"
    assert run.restarts == {} and run.view.stages == []


def test_exit_reasons():
    assert exit_reason(-9) == "killed by SIGKILL" and exit_reason(-15) == "killed by SIGTERM"
    assert exit_reason(1) == "exit code 1" and exit_reason(-200) == "killed by signal 200"


def test_train_and_the_job_api_restart_by_default_and_take_the_bound():
    parser, _ = build_parser()
    args = parser.parse_args(["train"])
    assert (args.max_restarts, args.restart_delay_s) == (MAX_RESTARTS, RESTART_DELAY_S)
    args = parser.parse_args(["train", "--max-restarts", "0", "--restart-delay-s", "1.5"])
    assert (args.max_restarts, args.restart_delay_s) == (0, 1.5)
    with pytest.raises(UsageError, match="--max-restarts: must be 0 or more"):
        parser.parse_args(["train", "--max-restarts", "-1"])
    defaults = JobsSettings(token="t")
    assert (defaults.max_restarts, defaults.restart_delay_s) == (MAX_RESTARTS, RESTART_DELAY_S)
    launcher = build_launcher(JobsSettings(token="t", max_restarts=5, restart_delay_s=2.0))
    assert (launcher.max_restarts, launcher.restart_delay_s) == (5, 2.0)


def test_a_restart_shows_on_the_live_line_until_the_next_step():
    from rich.console import Console

    from services.cli.live import LiveView
    from services.launcher.__main__ import TerminalView

    console = Console(file=io.StringIO(), width=200)
    view = TerminalView.__new__(TerminalView)  # its LiveView on a console of our own
    view.live = LiveView(3, console)
    try:
        view.step({"step": 1, "step_seconds": 1.0}, 3)
        view.stage({"stage": "restarting", "message": "reward exited (killed by SIGKILL); restarting it in 5s"})
        description = view.live.progress.tasks[0].description
        assert description.startswith("reward exited (killed by SIGKILL)")
        view.stage({"stage": "healthy", "message": "envs: healthy after 1s"})  # a start-up stage leaves it
        assert view.live.progress.tasks[0].description == description
        view.step({"step": 2, "step_seconds": 1.0}, 3)
        assert view.live.progress.tasks[0].description == "training"
    finally:
        view.close()
    assert "reward exited (killed by SIGKILL)" in console.file.getvalue()
