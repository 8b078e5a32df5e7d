"""The job lifecycle (JobManager) with a scripted launcher and a scripted progress source."""

import json
import re
import sqlite3

import pytest

from services.jobs import launchers
from services.jobs.launchers import SpecRejected
from services.jobs.manager import JobConflict, JobManager, new_job_id
from services.jobs.models import STATES
from services.jobs.spec import JobSpec
from services.jobs.store import JobStore
from tests.support.fake_launcher import FakeLauncher


class ScriptedProgress:
    def __init__(self):
        self.steps: dict[str, list[dict]] = {}
        self.version: int | None = None
        self.fail = False

    def read(self, config, cursor):
        if self.fail:
            raise ConnectionError("redis away")
        steps = self.steps.get(config.run, [])
        new = steps[int(cursor) :]
        return new, str(len(steps)), self.version


@pytest.fixture
def store(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    yield store
    store.close()


def states_of(store, job_id):
    return [e.data["state"] for e in store.events(job_id) if e.type == "state"]


def test_a_job_goes_from_queued_to_succeeded_with_its_steps_before_its_end(store):
    progress = ScriptedProgress()
    manager = JobManager(store, FakeLauncher(("running", "succeeded")), progress)
    job = manager.submit(JobSpec.model_validate({"run": "demo", "learner": {"steps": 2}}))
    assert job.state == "queued" and job.total_steps == 2 and job.id.startswith("demo-")
    manager.tick()  # starts it
    manager.tick()  # running
    progress.steps[job.id] = [
        {"step": 1, "reward_mean": 0.1, "policy_version": 1},
        {"step": 2, "reward_mean": float("nan"), "policy_version": 2},
    ]
    progress.version = 2
    manager.tick()  # succeeded, and the two steps read in the same pass
    record = manager.get(job.id)
    assert record.state == "succeeded" and record.step == 2 and record.policy_version == 2
    assert record.started_at and record.finished_at and record.error is None
    assert states_of(store, job.id) == ["queued", "starting", "running", "succeeded"]
    kinds = [e.type for e in store.events(job.id)]
    assert kinds.index("step") < len(kinds) - 1 and kinds[-1] == "state"
    assert [e.seq for e in store.events(job.id)] == list(range(1, len(kinds) + 1))


def test_the_launchers_capacity_queues_later_jobs(store):
    launcher = FakeLauncher(("running", "running", "succeeded"), capacity=1)
    manager = JobManager(store, launcher)
    first, second = (manager.submit(JobSpec(run=name)) for name in ("first", "second"))
    manager.tick()
    assert launcher.started == [first.id] and manager.get(second.id).state == "queued"
    for _ in range(3):
        manager.tick()
    assert manager.get(first.id).state == "succeeded"
    assert launcher.started == [first.id, second.id]


def test_cancelling_a_queued_job_never_starts_it(store):
    launcher = FakeLauncher(capacity=0)
    manager = JobManager(store, launcher)
    job = manager.submit(JobSpec())
    assert manager.cancel(job.id).state == "cancelled"
    manager.tick()
    assert launcher.started == [] and launcher.cancelled == []
    with pytest.raises(JobConflict):
        manager.cancel(job.id)


def test_cancelling_a_running_job_goes_through_cancelling(store):
    launcher = FakeLauncher(("running",))
    manager = JobManager(store, launcher)
    job = manager.submit(JobSpec())
    manager.tick()
    manager.tick()
    assert manager.cancel(job.id).state == "cancelling"
    assert manager.cancel(job.id).state == "cancelling" and launcher.cancelled == [job.id]  # idempotent
    manager.tick()
    record = manager.get(job.id)
    assert record.state == "cancelled" and record.finished_at
    assert states_of(store, job.id)[-2:] == ["cancelling", "cancelled"]


def test_a_launch_failure_fails_the_job_with_the_reason(store):
    launcher = FakeLauncher()
    launcher.fail_start = "no space left on device"
    manager = JobManager(store, launcher)
    job = manager.submit(JobSpec())
    manager.tick()
    record = manager.get(job.id)
    assert record.state == "failed" and "no space left on device" in record.error


def test_a_launcher_hiccup_on_one_job_leaves_the_others_going(store):
    launcher = FakeLauncher(("running", "succeeded"))
    manager = JobManager(store, launcher)
    stuck, fine = manager.submit(JobSpec(run="stuck")), manager.submit(JobSpec(run="fine"))
    manager.tick()
    launcher.unreachable.add(stuck.id)
    manager.tick()
    manager.tick()
    assert manager.get(stuck.id).state == "starting" and manager.get(fine.id).state == "succeeded"


def test_unreadable_progress_does_not_stop_the_state_machine(store):
    progress = ScriptedProgress()
    progress.fail = True
    manager = JobManager(store, FakeLauncher(("running", "succeeded")), progress)
    job = manager.submit(JobSpec())
    for _ in range(3):
        manager.tick()
    assert manager.get(job.id).state == "succeeded"


def test_launcher_messages_and_errors_become_events(store):
    launcher = FakeLauncher(("failed",))
    manager = JobManager(store, launcher)
    job = manager.submit(JobSpec())
    manager.tick()
    launcher.messages[job.id] = ["learner pod: OOMKilled"]
    launcher.errors[job.id] = "learner exited with 1"
    manager.tick()
    events = store.events(job.id)
    assert [e.data for e in events if e.type == "message"] == [{"message": "learner pod: OOMKilled"}]
    assert events[-1].data == {"state": "failed", "error": "learner exited with 1"}
    assert manager.get(job.id).error == "learner exited with 1"


def test_recover_takes_up_unfinished_jobs_and_marks_them(store):
    launcher = FakeLauncher(("running",))
    manager = JobManager(store, launcher)
    running = manager.submit(JobSpec(run="running"))
    manager.tick()
    queued = manager.submit(JobSpec(run="queued"))
    restarted = JobManager(store, launcher)  # the API comes back on the same store
    restarted.recover()
    record = restarted.get(running.id)
    assert record.recovered_at is not None and record.state == "running"
    assert any(e.data.get("recovered") for e in store.events(running.id))
    assert launcher.recovered == [running.id]
    assert restarted.get(queued.id).state == "queued" and restarted.get(queued.id).recovered_at is None


def test_a_spec_the_launcher_cannot_run_is_not_stored(store):
    manager = JobManager(store, FakeLauncher())
    with pytest.raises(SpecRejected):
        manager.submit(JobSpec.model_validate({"env": {"name": "babyai"}}))
    assert store.list()[1] == 0


def test_the_api_knows_every_state_a_launcher_reports():
    assert launchers.TERMINAL | {launchers.STARTING, launchers.RUNNING, launchers.CANCELLING} <= set(STATES)


@pytest.mark.parametrize("name", ["default", "Qwen 2.5 / GRPO!", "123", "__", "x" * 80])
def test_job_ids_are_dns_labels(name):
    job_id = new_job_id(name)
    assert re.fullmatch(r"[a-z][a-z0-9-]*[a-z0-9]", job_id) and len(job_id) <= 40
    assert new_job_id(name) != job_id


def corrupt(db_path, job_id: str) -> None:
    """What the API stored before it rejected Infinity: a spec field that reads back as null."""
    with sqlite3.connect(db_path) as db:
        doc = json.loads(db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])
        doc["spec"]["algorithm"]["kl_coef"] = None
        db.execute("UPDATE jobs SET doc = ? WHERE id = ?", (json.dumps(doc), job_id))


@pytest.mark.parametrize("state", ["queued", "running"])
def test_an_unreadable_record_fails_alone_and_says_why(store, tmp_path, state):
    launcher = FakeLauncher(("running", "succeeded"))
    manager = JobManager(store, launcher)
    broken = manager.submit(JobSpec(run="broken"))
    if state == "running":
        manager.tick()
    fine = manager.submit(JobSpec(run="fine"))
    corrupt(tmp_path / "jobs.sqlite", broken.id)
    manager.tick()
    manager.tick()
    assert manager.get(fine.id).state in {"running", "succeeded"}
    record = manager.get(broken.id)
    assert record.state == "failed" and "unreadable" in record.error and "algorithm.kl_coef" in record.error
    kept = [e.data for e in store.events(broken.id) if "stored_record" in e.data]
    assert kept and '"kl_coef": null' in kept[0]["stored_record"]
    assert launcher.cancelled == ([broken.id] if state == "running" else [])


def test_recover_repairs_unreadable_finished_records_keeping_their_state(store, tmp_path):
    manager = JobManager(store, FakeLauncher(("succeeded",)))
    done = manager.submit(JobSpec(run="done"))
    manager.tick()
    manager.tick()
    assert manager.get(done.id).state == "succeeded"
    corrupt(tmp_path / "jobs.sqlite", done.id)
    manager.recover()
    record = store.list()[0][0]
    assert record.state == "succeeded" and "unreadable" in record.error


def test_an_alert_on_the_metrics_stream_is_an_alert_event_not_a_step(store):
    progress = ScriptedProgress()
    manager = JobManager(store, FakeLauncher(("running", "running")), progress)
    job = manager.submit(JobSpec.model_validate({"run": "demo", "learner": {"steps": 2}}))
    manager.tick()
    progress.steps[job.id] = [
        {"step": 1, "reward_mean": 0.1, "policy_version": 1},
        {"kind": "alert", "what": "task_quarantined", "task": 5, "reason": "hung", "message": "task 5 quarantined"},
    ]
    manager.tick()
    alerts = [e.data for e in store.events(job.id) if e.type == "alert"]
    assert [a["task"] for a in alerts] == [5] and "quarantined" in alerts[0]["message"]
    record = manager.get(job.id)
    assert record.step == 1 and record.metrics["reward_mean"] == 0.1, "the alert is not the latest step"
