"""Start-up stages travel from a local run to the job's event stream as structured events: LocalRun says
them through its view, the supervisor writes them as `@stage` lines, the local launcher reads them back
as dict messages, and the manager stores them as message events with `service` and `stage`."""

from pathlib import Path

from services.common.config import load_config
from services.jobs.manager import JobManager
from services.jobs.spec import JobSpec
from services.jobs.store import JobStore
from services.launcher.local import LocalLauncher, LocalRun
from services.launcher.processes import ServiceProcess
from services.launcher.report import SupervisorView, decode_stage, encode_stage, stage_record
from tests.support.fake_launcher import FakeLauncher


def test_a_stage_line_round_trips_and_other_lines_are_not_stages():
    record = stage_record("rollout", "loading", "rollout: loading the vLLM engine (10s)", elapsed_s=10.0)
    assert decode_stage(encode_stage(record)) == record
    assert decode_stage("rollout: healthy") is None and decode_stage("@stage {not json") is None
    assert decode_stage('@stage {"service": "x"}') is None  # no message: not an event a person can read


def test_the_local_launcher_turns_stage_lines_into_structured_messages(tmp_path):
    run_dir = tmp_path / "job-1"
    (run_dir / "logs").mkdir(parents=True)
    lines = [
        encode_stage(stage_record("model", "building", "model: building the tiny model")),
        "task dataset: data/corridor",
        "step   1/2 | reward +0.100 | success  50.0% | kl 0.0010 | mismatch 1.0e-03 |   2.0s | policy v1",
        encode_stage(stage_record("rollout", "healthy", "rollout: healthy after 21s", elapsed_s=21.0)),
    ]
    (run_dir / "logs" / "supervisor.log").write_text("\n".join(lines) + "\n")
    handle = {"run_dir": str(run_dir), "log_offset": 0}
    messages = LocalLauncher(tmp_path)._new_log_lines(handle)
    assert messages == [
        {"message": "model: building the tiny model", "service": "model", "stage": "building"},
        "task dataset: data/corridor",
        {"message": "rollout: healthy after 21s", "service": "rollout", "stage": "healthy", "elapsed_s": 21.0},
    ]


def test_the_manager_stores_structured_messages_as_they_are(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    launcher = FakeLauncher(("starting", "running"))
    manager = JobManager(store, launcher)
    job = manager.submit(JobSpec.model_validate({"run": "demo", "learner": {"steps": 2}}))
    manager.tick()
    launcher.messages[job.id] = [
        {"message": "rollout: healthy after 3s", "service": "rollout", "stage": "healthy"},
        "plain line",
    ]
    manager.tick()
    messages = [e.data for e in store.events(job.id) if e.type == "message"]
    assert messages == [
        {"message": "rollout: healthy after 3s", "service": "rollout", "stage": "healthy"},
        {"message": "plain line"},
    ]
    store.close()


class Recorder:
    def __init__(self):
        self.stages, self.steps = [], []

    def stage(self, record):
        self.stages.append(record)

    def step(self, metrics, total):
        self.steps.append((metrics["step"], total))


def test_waiting_for_a_slow_service_reports_progress_then_healthy(tmp_path, monkeypatch):
    """The 25 s of silence while vLLM's engine loads: now a line after 5 s, then every 15 s, then `healthy`."""
    config = load_config(None, [f"output_dir={tmp_path}"])
    view = Recorder()
    run = LocalRun(config, say=lambda _: None, view=view)
    proc = ServiceProcess("rollout", ["true"], tmp_path / "r.log", "127.0.0.1:1")

    def wait_healthy(timeout_s, on_wait=None):
        for elapsed in (5.0, 10.0, 15.0, 20.1, 25.1, 30.1, 35.2):
            on_wait(elapsed)
        return 37.4

    monkeypatch.setattr(proc, "wait_healthy", wait_healthy)
    run._wait_healthy(proc)
    assert [(s["stage"], s["message"]) for s in view.stages] == [
        ("loading", "rollout: loading the vLLM engine (5s)"),
        ("loading", "rollout: loading the vLLM engine (20s)"),
        ("loading", "rollout: loading the vLLM engine (35s)"),
        ("healthy", "rollout: healthy after 37s"),
    ]
    assert all(s["service"] == "rollout" for s in view.stages)


def test_the_supervisor_view_writes_stages_as_event_lines_and_steps_as_plain_lines():
    lines = []
    view = SupervisorView(lines.append)
    view.stage(stage_record("envs", "healthy", "envs: healthy after 1s"))
    view.step(
        {
            "step": 1,
            "reward_mean": 0.5,
            "success_rate": 0.5,
            "approx_kl": 0.0,
            "mismatch_kl": 0.0,
            "step_seconds": 1.0,
            "policy_version": 1,
        },
        2,
    )
    assert decode_stage(lines[0])["message"] == "envs: healthy after 1s"
    assert lines[1].startswith("step   1/2 | reward +0.500")
    assert LocalLauncher._NOISE.search(lines[1])  # steps reach the API from the metrics stream, not the log
    assert not LocalLauncher._NOISE.search(lines[0])


def test_start_up_stages_of_the_tiny_model_are_reported(tmp_path, monkeypatch):
    import services.launcher.tiny as tiny

    monkeypatch.setattr(tiny, "prepare_tiny_model", lambda config, root, say: Path(root) / "built")
    config = load_config(None, [f"output_dir={tmp_path}", "model.warmstart_steps=20"])
    view = Recorder()
    LocalRun(config, say=lambda _: None, view=view).prepare_model()
    assert [(s["service"], s["stage"]) for s in view.stages] == [("model", "building"), ("model", "ready")]
    assert "20 warm-start steps" in view.stages[0]["message"]
