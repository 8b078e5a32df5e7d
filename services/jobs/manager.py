"""The job lifecycle, in one plain class: submit, cancel, and a reconcile pass (`tick`) that starts queued
jobs when the launcher has room, polls running ones, and turns what it sees (state changes, step metrics,
launcher messages) into the job's record and events. `recover` runs once when the API starts."""

from __future__ import annotations

import logging
import re
import secrets
import threading
from typing import Any

from services.jobs.launchers import STARTING, TERMINAL, Launcher, LaunchStatus
from services.jobs.models import ACTIVE, JobRecord, now
from services.jobs.progress import ProgressReader
from services.jobs.spec import JobSpec
from services.jobs.store import JobStore, UnreadableRecord

log = logging.getLogger(__name__)


class JobNotFound(KeyError):
    pass


class JobConflict(RuntimeError):
    pass


def new_job_id(name: str) -> str:
    """`<name>-<8 hex>`, a DNS label (Kubernetes object names derive from it)."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:24].strip("-")
    if not slug or not slug[0].isalpha():
        slug = f"job-{slug}".strip("-")
    return f"{slug}-{secrets.token_hex(4)}"


class JobManager:
    def __init__(self, store: JobStore, launcher: Launcher, progress: ProgressReader | None = None):
        self.store, self.launcher, self.progress = store, launcher, progress
        self._lock = threading.RLock()  # one writer per record at a time: API requests vs the reconcile pass

    def get(self, job_id: str) -> JobRecord:
        record = self.store.get(job_id)
        if record is None:
            raise JobNotFound(job_id)
        return record

    def submit(self, spec: JobSpec) -> JobRecord:
        self.launcher.check(spec)
        stamp = now()
        record = JobRecord(
            id=new_job_id(spec.run),
            name=spec.run,
            state="queued",
            launcher=self.launcher.name,
            created_at=stamp,
            updated_at=stamp,
            total_steps=spec.learner.steps,
            spec=spec,
        )
        self.store.insert(record)
        self.store.add_events(record.id, [("state", {"state": "queued"})])
        return record

    def cancel(self, job_id: str) -> JobRecord:
        with self._lock:
            record = self.get(job_id)
            if record.finished:
                raise JobConflict(f"job {job_id} is already {record.state}")
            if record.state == "queued":
                self._set_state(record, LaunchStatus("cancelled"), [])
            elif record.state != "cancelling":
                record.launcher_info = self.launcher.cancel(record.id, record.launcher_info)
                self._set_state(record, LaunchStatus("cancelling"), [])
            return record

    # -- reconcile ---------------------------------------------------------------------------------
    def recover(self) -> None:
        self.fail_unreadable(unfinished_only=False)
        for record in self.store.unfinished():
            if record.state == "queued":
                continue
            with self._lock:
                record = self.get(record.id)
                try:
                    status = self.launcher.recover(record.id, record.launcher_info)
                except Exception:  # the next tick polls it again
                    log.exception("recovering job %s", record.id)
                    continue
                record.recovered_at = now()
                note = {"message": f"job API restarted while this job was {record.state}", "recovered": True}
                self._apply(record, status, [("message", note)])

    def tick(self) -> None:
        self.fail_unreadable()
        for record in self.store.unfinished():
            if record.state in ACTIVE:
                with self._lock:
                    record = self.get(record.id)
                    if record.finished:
                        continue
                    try:
                        status = self.launcher.poll(record.id, record.launcher_info)
                    except Exception:  # a launcher hiccup (API server, files) must not stop the others
                        log.exception("polling job %s", record.id)
                        continue
                    self._apply(record, status, [])
        self._start_queued()

    def fail_unreadable(self, unfinished_only: bool = True) -> None:
        """A record that no longer loads fails alone, saying why; whatever it had running is cancelled."""
        for problem in self.store.unreadable(unfinished_only):
            self.repair(problem)

    def repair(self, problem: UnreadableRecord) -> JobRecord:
        with self._lock:
            log.error("%s; replacing it with a record that says so", problem)
            record = self.store.quarantine(problem)
            if record.launcher_info and record.state == "failed":
                try:
                    self.launcher.cancel(record.id, record.launcher_info)
                except Exception:  # best effort: the record no longer says reliably what runs
                    log.exception("cancelling what unreadable job %s left running", record.id)
            return record

    def _start_queued(self) -> None:
        capacity, unfinished = self.launcher.capacity(), self.store.unfinished()
        active = sum(r.state in ACTIVE for r in unfinished)
        for queued in (r for r in unfinished if r.state == "queued"):
            if capacity is not None and active >= capacity:
                return
            with self._lock:
                record = self.get(queued.id)
                if record.state != "queued":
                    continue
                try:
                    record.launcher_info = self.launcher.start(record.id, record.spec)
                except Exception as exc:
                    log.exception("starting job %s", record.id)
                    self._set_state(record, LaunchStatus("failed", error=f"launch failed: {exc}"), [])
                    continue
                record.started_at = now()
                self._set_state(record, LaunchStatus(STARTING), [])
                active += 1

    def _apply(self, record: JobRecord, status: LaunchStatus, events: list[tuple[str, dict[str, Any]]]) -> None:
        events += [("message", m if isinstance(m, dict) else {"message": m}) for m in status.messages]
        if status.handle is not None:
            record.launcher_info = status.handle
        self._read_progress(record, events)  # before the state: a job's last steps come before its end
        self._set_state(record, status, events)

    def _set_state(self, record: JobRecord, status: LaunchStatus, events: list[tuple[str, dict[str, Any]]]) -> None:
        if status.state != record.state:
            record.state = status.state
            if status.state in TERMINAL:
                record.finished_at, record.error = now(), status.error
            events.append(("state", {"state": status.state, **({"error": status.error} if status.error else {})}))
        # events first: whoever sees the record finished finds all its events already there
        if events:
            self.store.add_events(record.id, events)
        self.store.save(record)

    def _read_progress(self, record: JobRecord, events: list[tuple[str, dict[str, Any]]]) -> None:
        if self.progress is None:
            return
        try:
            config = self.launcher.run_config(record.id, record.spec)
            steps, record.metrics_cursor, version = self.progress.read(config, record.metrics_cursor)
        except Exception as exc:  # Redis away: the steps are read next time
            log.warning("job %s: progress not readable: %s", record.id, exc)
            return
        alerts = [m for m in steps if m.get("kind") == "alert"]  # a task quarantined: which, where, why
        steps = [m for m in steps if m.get("kind") != "alert"]
        events += [("alert", m) for m in alerts] + [("step", m) for m in steps]
        if steps:
            record.metrics = steps[-1]
            record.step = int(steps[-1].get("step") or record.step)
        if version is not None:
            record.policy_version = version
