"""What the job API stores and returns."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field

from services.jobs.launchers import TERMINAL
from services.jobs.spec import JobSpec

JobState = Literal["queued", "starting", "running", "cancelling", "succeeded", "failed", "cancelled", "interrupted"]
STATES: tuple[str, ...] = get_args(JobState)
ACTIVE = frozenset({"starting", "running", "cancelling"})
JOB_ID_PATTERN = r"^[a-z][a-z0-9-]{0,62}$"


def now() -> datetime:
    return datetime.now(timezone.utc)


class Job(BaseModel):
    id: str
    """Job id; also the run name that scopes its Redis keys, run directory and Kubernetes objects."""
    name: str
    """The spec's `run`."""
    state: JobState
    launcher: str
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    step: int = 0
    """Learner steps done."""
    total_steps: int
    policy_version: int | None = None
    """Policy version the rollout servers were last sent."""
    metrics: dict[str, Any] = Field(default_factory=dict)
    """Latest step's metrics (reward_mean, success_rate, loss, ...)."""
    error: str | None = None
    recovered_at: datetime | None = None
    """Set when a restarted API found this job unfinished and took it up again."""
    launcher_info: dict[str, Any] = Field(default_factory=dict)
    """Where the launcher runs the job (local: run directory and supervisor pid; kubernetes: objects)."""
    spec: JobSpec

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


class JobRecord(Job):
    metrics_cursor: str = "0"
    """Last metrics-stream entry turned into an event."""


class JobPage(BaseModel):
    jobs: list[Job]
    total: int


class Event(BaseModel):
    seq: int
    """Per-job sequence number, from 1; pass the last one seen as `after` to resume."""
    time: datetime
    type: Literal["state", "step", "message", "alert"]
    """`alert`: the run told of a problem (a task quarantined: which task, which server, why)."""
    data: dict[str, Any]


class EventPage(BaseModel):
    events: list[Event]
    next_after: int
    """Cursor for the next request."""
    job_state: JobState
    finished: bool
    """The job is finished and every event up to `next_after` was returned: nothing more will come."""
