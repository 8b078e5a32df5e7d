"""Job records and their events in one SQLite file.

Why SQLite: the API is the only writer (one replica; the cluster, not the API, is the source of truth
for running Kubernetes jobs), a record is one small JSON document, and a file on a volume survives
restarts with no server to run. A multi-replica API would move this class onto PostgreSQL."""
from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any, Iterable

from services.jobs.models import Event, JobRecord, now
from services.launcher.base import TERMINAL

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, state TEXT NOT NULL, created_at REAL NOT NULL, doc TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, seq INTEGER NOT NULL, time TEXT NOT NULL, type TEXT NOT NULL, data TEXT NOT NULL,
  PRIMARY KEY (job_id, seq));
"""


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
            self._db.execute("INSERT INTO jobs (id, state, created_at, doc) VALUES (?, ?, ?, ?)",
                             (record.id, record.state, record.created_at.timestamp(), record.model_dump_json()))

    def save(self, record: JobRecord) -> None:
        record.updated_at = now()
        with self._lock:
            self._db.execute("UPDATE jobs SET state = ?, doc = ? WHERE id = ?",
                             (record.state, record.model_dump_json(), record.id))

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT doc FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return JobRecord.model_validate_json(row[0]) if row else None

    def list(self, states: Iterable[str] | None = None, limit: int = 100,
             offset: int = 0) -> tuple[list[JobRecord], int]:
        """Newest first, and the number of matching jobs."""
        where, args = "", []
        if states is not None:
            states = list(states)
            where, args = f"WHERE state IN ({','.join('?' * len(states))})", states
        with self._lock:
            rows = self._db.execute(f"SELECT doc FROM jobs {where} ORDER BY created_at DESC, id LIMIT ? OFFSET ?",
                                    (*args, limit, offset)).fetchall()
            total = self._db.execute(f"SELECT COUNT(*) FROM jobs {where}", args).fetchone()[0]
        return [JobRecord.model_validate_json(r[0]) for r in rows], total

    def unfinished(self) -> list[JobRecord]:
        """Oldest first (the queue order)."""
        marks = ",".join("?" * len(TERMINAL))
        with self._lock:
            rows = self._db.execute(f"SELECT doc FROM jobs WHERE state NOT IN ({marks}) ORDER BY created_at, id",
                                    tuple(TERMINAL)).fetchall()
        return [JobRecord.model_validate_json(r[0]) for r in rows]

    def count_by_state(self) -> dict[str, int]:
        with self._lock:
            return dict(self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

    # -- events ----------------------------------------------------------------------------------
    def add_events(self, job_id: str, events: list[tuple[str, dict[str, Any]]]) -> int:
        """Appends events in order; returns the last sequence number."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE job_id = ?",
                                       (job_id,)).fetchone()[0]
                stamp = now().isoformat()
                for kind, data in events:
                    seq += 1
                    self._db.execute("INSERT INTO events (job_id, seq, time, type, data) VALUES (?, ?, ?, ?, ?)",
                                     (job_id, seq, stamp, kind, json.dumps(data)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return seq

    def events(self, job_id: str, after: int = 0, limit: int = 500) -> list[Event]:
        with self._lock:
            rows = self._db.execute("SELECT seq, time, type, data FROM events WHERE job_id = ? AND seq > ? "
                                    "ORDER BY seq LIMIT ?", (job_id, after, limit)).fetchall()
        return [Event(seq=s, time=t, type=k, data=json.loads(d)) for s, t, k, d in rows]
