"""The local launcher gives each run its own weight-push token, in the environment of exactly the two
processes that use it (learner and rollout server)."""

import types

from services.common.config import TrainConfig
from services.common.run_state import RunState
from services.launcher import local
from services.launcher.processes import ServiceProcess


def started_processes(monkeypatch, tmp_path, run_name, redis_url):
    started = []

    def fake_start(self):
        self.popen = types.SimpleNamespace(pid=1000 + len(started))
        started.append(self)
        return self

    monkeypatch.setattr(ServiceProcess, "start", fake_start)
    monkeypatch.setattr(ServiceProcess, "wait_healthy", lambda self, timeout_s, on_wait=None: 0.0)
    monkeypatch.setattr("services.envs.datasets.ensure", lambda env: "test-tasks")
    config = TrainConfig(run=run_name, output_dir=str(tmp_path))
    config.model.path = str(tmp_path / "model")
    config.stream.redis_url = redis_url
    local.LocalRun(config, say=lambda _: None).start()
    RunState.connect(config).reset()
    return {p.name: p for p in started}


def test_each_run_gets_a_fresh_token_for_its_learner_and_rollout_only(monkeypatch, tmp_path, run_name, redis_url):
    first = started_processes(monkeypatch, tmp_path / "a", run_name, redis_url)
    second = started_processes(monkeypatch, tmp_path / "b", run_name + "-b", redis_url)
    token = first["rollout"].env["OMRL_WEIGHT_TOKEN"]
    assert len(token) >= 32 and first["learner"].env["OMRL_WEIGHT_TOKEN"] == token
    assert second["rollout"].env["OMRL_WEIGHT_TOKEN"] != token
    assert all("OMRL_WEIGHT_TOKEN" not in p.env for name, p in first.items() if name not in ("rollout", "learner"))
