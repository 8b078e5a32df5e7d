"""JobStore: records and events in SQLite, kept across reopening the file."""

import pytest

from services.jobs.models import JobRecord, now
from services.jobs.spec import JobSpec
from services.jobs.store import JobStore


def record(job_id: str, state: str = "queued") -> JobRecord:
    stamp = now()
    return JobRecord(
        id=job_id,
        name=job_id,
        state=state,
        launcher="local",
        created_at=stamp,
        updated_at=stamp,
        total_steps=3,
        spec=JobSpec.model_validate({"run": job_id, "learner": {"steps": 3}}),
    )


def test_records_and_events_survive_reopening_the_file(tmp_path):
    path = tmp_path / "jobs.sqlite"
    store = JobStore(path)
    job = record("a-1")
    store.insert(job)
    job.state, job.step, job.metrics = "running", 2, {"reward_mean": 0.5}
    store.save(job)
    assert store.add_events("a-1", [("state", {"state": "queued"}), ("step", {"step": 1})]) == 2
    store.close()
    again = JobStore(path)
    got = again.get("a-1")
    assert got.state == "running" and got.step == 2 and got.metrics == {"reward_mean": 0.5}
    assert got.spec.learner.steps == 3
    assert again.add_events("a-1", [("step", {"step": 2})]) == 3
    assert [(e.seq, e.type) for e in again.events("a-1", after=1)] == [(2, "step"), (3, "step")]


def test_list_filters_by_state_newest_first_with_a_total(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    for i, state in enumerate(["queued", "running", "succeeded", "running"]):
        store.insert(record(f"j-{i}", state))
    jobs, total = store.list(["running"])
    assert [j.id for j in jobs] == ["j-3", "j-1"] and total == 2
    jobs, total = store.list(limit=1, offset=1)
    assert [j.id for j in jobs] == ["j-2"] and total == 4
    assert [j.id for j in store.unfinished()] == ["j-0", "j-1", "j-3"]
    assert store.count_by_state() == {"queued": 1, "running": 2, "succeeded": 1}


def test_event_numbers_are_per_job(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite")
    store.add_events("a", [("state", {})])
    store.add_events("b", [("state", {}), ("state", {})])
    assert [e.seq for e in store.events("a")] == [1] and [e.seq for e in store.events("b")] == [1, 2]


def test_a_duplicate_id_is_refused(tmp_path):
    import sqlite3

    store = JobStore(tmp_path / "jobs.sqlite")
    store.insert(record("same"))
    with pytest.raises(sqlite3.IntegrityError):
        store.insert(record("same"))
