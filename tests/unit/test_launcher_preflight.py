"""The local launcher checks the env's backends (`TextEnv.preflight`) before it builds a model or starts a
service: a failure ends the launch at once in one line, a success is said in one."""

import pytest

from services.common.config import EnvConfig, load_config
from services.envs import registry
from services.envs.base import InvalidTask
from services.launcher import __main__ as launcher
from services.launcher import local

DOWN = "AgentGym textcraft server http://127.0.0.1:1: GET /: ConnectError: [Errno 111] Connection refused"


class Built(Exception):
    """The launch got past the check to the model."""


class Checks:
    """Stands in for `services.envs.registry.preflight`: records each env checked, answers `answer` (raised
    where it is an exception)."""

    def __init__(self):
        self.answer: str | Exception | None = None
        self.seen: list[str] = []

    def __call__(self, env):
        self.seen.append(env.name)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.fixture
def checks(monkeypatch):
    from services.common import logs

    def build(self):
        raise Built()

    stand_in = Checks()
    monkeypatch.setattr(registry, "preflight", stand_in)
    monkeypatch.setattr(local.LocalRun, "prepare_model", build)
    monkeypatch.setattr(logs, "setup_logging", lambda *a, **k: "text")
    monkeypatch.setattr(launcher.signal, "signal", lambda *a: None)  # the launcher's handlers stay its own
    return stand_in


def test_a_built_in_env_has_nothing_to_check():
    assert registry.preflight(EnvConfig()) is None


def test_a_failed_check_ends_the_launch_in_one_line_before_the_model(checks, capsys, tmp_path):
    checks.answer = InvalidTask(DOWN)
    args = ["train", "--plain", "--output_dir", str(tmp_path), "--run", "r", "--env.data_dir", str(tmp_path)]
    assert launcher.main(args) == 1
    assert checks.seen == ["corridor"]
    assert capsys.readouterr().err == (
        f"python -m services.launcher: run failed: {DOWN} (logs in {tmp_path}/r/logs; --debug shows the traceback)\n"
    )


def test_a_passed_check_is_said_before_the_model_is_built(checks, tmp_path):
    checks.answer = "env servers: http://127.0.0.1:8000 (textcraft) ok"
    config = load_config(None, [f"output_dir={tmp_path}", f"env.data_dir={tmp_path}"])
    lines = []
    with pytest.raises(Built):
        local.LocalRun(config, say=lines.append).start()
    assert lines[0] == checks.answer and lines[1].startswith("task dataset: ")


def test_an_env_service_started_without_a_launcher_checks_its_servers_and_alerts_on_failure(monkeypatch, caplog):
    """On Kubernetes no launcher checks: the env service does at start-up, logs the line, publishes it as an
    alert (the job's events), and serves anyway (the servers may come up after it)."""
    from services.envs import __main__ as envs_main
    from services.envs import alerts

    caplog.set_level("INFO", logger="services.envs")
    checks, sent = Checks(), []
    monkeypatch.setattr(registry, "preflight", checks)
    monkeypatch.setattr(alerts, "alert", lambda what, message, **fields: sent.append((what, message)))
    config = load_config(None, ["env.name=agentgym", "env.options={family: textcraft, base_url: 'http://s:1'}"])
    checks.answer = InvalidTask(DOWN)
    envs_main.check_servers(config)
    assert checks.seen == ["agentgym"] and sent == [
        ("env_server_check_failed", f"env servers failed their start-up check: {DOWN}")
    ]
    assert any(DOWN in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    checks.answer, sent[:] = "env servers: http://s:1 (textcraft) ok", []
    envs_main.check_servers(config)
    assert sent == [] and any("(textcraft) ok" in r.getMessage() for r in caplog.records)
