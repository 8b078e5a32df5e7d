"""Job records and their events in one SQLite file.

Why SQLite: the API is the only writer (one replica; the cluster, not the API, is the source of truth
for running Kubernetes jobs), a record is one small JSON document, and a file on a volume survives
restarts with no server to run. A multi-replica API would move this class onto PostgreSQL."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from services.jobs.launchers import FAILED, TERMINAL
from services.jobs.models import Event, JobRecord, now
from services.jobs.spec import JobSpec

KEPT_DOC_CHARS = 64 * 1024

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, state TEXT NOT NULL, created_at REAL NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, seq INTEGER NOT NULL, time TEXT NOT NULL, type TEXT NOT NULL, data TEXT NOT NULL,
  PRIMARY KEY (job_id, seq));
"""


class UnreadableRecord(RuntimeError):
    """A stored job document that no longer loads (written by an older version, or damaged)."""

    def __init__(self, job_id: str, reason: str):
        super().__init__(f"stored record of job {job_id} is unreadable: {reason}")
        self.job_id, self.reason = job_id, reason


def load_record(job_id: str, doc: str) -> JobRecord:
    try:
        return JobRecord.model_validate_json(doc)
    except ValidationError as exc:
        raise UnreadableRecord(
            job_id, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        ) from None


class JobStore:
    def __init__(self, path: str | Path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=10)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def ping(self) -> None:
        with self._lock:
            self._db.execute("SELECT 1").fetchone()

    # -- jobs ------------------------------------------------------------------------------------
    def insert(self, record: JobRecord) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO jobs (id, state, created_at, doc) VALUES (?, ?, ?, ?)",
                (record.id, record.state, record.created_at.timestamp(), record.model_dump_json()),
            )

    def save(self, record: JobRecord) -> None:
        record.updated_at = now()
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET state = ?, doc = ? WHERE id = ?", (record.state, record.model_dump_json(), record.id)
            )

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return load_record(job_id, row[0]) if row else None

    def list(
        self, states: Iterable[str] | None = None, limit: int = 100, offset: int = 0
    ) -> tuple[list[JobRecord], int]:
        """Newest first, and the number of matching jobs."""
        where, args = "", []
        if states is not None:
            states = list(states)
            where, args = f"WHERE state IN ({','.join('?' * len(states))})", states
        with self._lock:
            rows = self._db.execute(
                f"SELECT id, doc FROM jobs {where} ORDER BY created_at DESC, id LIMIT ? OFFSET ?",
                (*args, limit, offset),
            ).fetchall()
            total = self._db.execute(f"SELECT COUNT(*) FROM jobs {where}", args).fetchone()[0]
        return [load_record(*row) for row in rows], total

    def unfinished(self) -> list[JobRecord]:
        """Oldest first (the queue order); unreadable records are left out (see `unreadable`)."""
        return self._readable(self._rows(finished=False))

    def unreadable(self, unfinished_only: bool = True) -> list[UnreadableRecord]:
        out = []
        for job_id, doc in self._rows(finished=None if not unfinished_only else False):
            try:
                load_record(job_id, doc)
            except UnreadableRecord as exc:
                out.append(exc)
        return out

    def quarantine(self, problem: UnreadableRecord) -> JobRecord:
        """Replaces an unreadable record with a readable one that says why: failed unless it had finished, its
        spec the defaults; the original document is kept (truncated) in the job's events."""
        with self._lock:
            row = self._db.execute("SELECT doc, created_at, state FROM jobs WHERE id = ?", (problem.job_id,)).fetchone()
        doc, created, state = row
        try:
            return load_record(problem.job_id, doc)  # repaired meanwhile (by a request or the reconcile pass)
        except UnreadableRecord:
            pass
        state = state if state in TERMINAL else FAILED
        try:
            old = json.loads(doc)
        except ValueError:
            old = {}
        old = old if isinstance(old, dict) else {}
        info = old.get("launcher_info")
        stamp = now()
        record = JobRecord(
            id=problem.job_id,
            name=str(old.get("name") or problem.job_id)[:200],
            state=state,
            launcher=str(old.get("launcher") or "unknown")[:200],
            created_at=datetime.fromtimestamp(created, timezone.utc),
            updated_at=stamp,
            finished_at=stamp,
            total_steps=0,
            error=str(problem),
            launcher_info=info if isinstance(info, dict) else {},
            spec=JobSpec(run="unreadable"),
        )
        self.add_events(
            record.id,
            [
                (
                    "message",
                    {
                        "message": "stored record unreadable; its document is kept here",
                        "stored_record": doc[:KEPT_DOC_CHARS],
                    },
                ),
                *([("state", {"state": FAILED, "error": str(problem)})] if state == FAILED else []),
            ],
        )
        self.save(record)
        return record

    def _rows(self, finished: bool | None) -> list[tuple[str, str]]:
        marks = ",".join("?" * len(TERMINAL))
        where, args = (f"WHERE state NOT IN ({marks})", tuple(TERMINAL)) if finished is False else ("", ())
        with self._lock:
            return self._db.execute(f"SELECT id, doc FROM jobs {where} ORDER BY created_at, id", args).fetchall()

    @staticmethod
    def _readable(rows: list[tuple[str, str]]) -> list[JobRecord]:
        out = []
        for row in rows:
            try:
                out.append(load_record(*row))
            except UnreadableRecord:
                pass
        return out

    def count_by_state(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

    # -- events ----------------------------------------------------------------------------------
    def add_events(self, job_id: str, events: list[tuple[str, dict[str, Any]]]) -> int:
        """Appends events in order; returns the last sequence number."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                seq = self._db.execute(
                    "SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id = ?", (job_id,)
                ).fetchone()[0]
                stamp = now().isoformat()
                for kind, data in events:
                    seq += 1
                    self._db.execute(
                        "INSERT INTO events (job_id, seq, time, type, data) VALUES (?, ?, ?, ?, ?)",
                        (job_id, seq, stamp, kind, json.dumps(data)),
                    )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return seq

    def events(self, job_id: str, after: int = 0, limit: int = 500) -> list[Event]:
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, time, type, data FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                (job_id, after, limit),
            ).fetchall()
        return [Event(seq=s, time=t, type=k, data=json.loads(d)) for s, t, k, d in rows]
