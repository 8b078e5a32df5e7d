"""The job API's jobs: list and status from its store, per-step metrics from the jobs' `step` events (what the
API read off each run's metrics stream), episodes from the job's run folder where that is on this machine (the
local launcher's `runs/jobs/<job>/`; a Kubernetes job's folder is on its volume, not here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.jobs.inspector.sources.base import (
    CANCELLED,
    FAILED,
    RUNNING,
    SUCCEEDED,
    UNKNOWN,
    RunInfo,
    RunNotFound,
    RunSource,
    last_per_step,
)
from services.jobs.models import Job
from services.jobs.store import JobStore, UnreadableRecord

STATUS_OF_STATE = {
    "queued": RUNNING,
    "starting": RUNNING,
    "running": RUNNING,
    "cancelling": RUNNING,
    "succeeded": SUCCEEDED,
    "failed": FAILED,
    "interrupted": FAILED,
    "cancelled": CANCELLED,
}
EVENTS_PAGE = 500
MAX_JOBS = 200


def local_folder(job: Job) -> Path | None:
    path = job.launcher_info.get("run_dir")
    return Path(path) if isinstance(path, str) and Path(path).is_dir() else None


def job_info(job: Job) -> RunInfo:
    detail = job.state if not job.error else f"{job.state}: {job.error}"
    return RunInfo(
        job.id, STATUS_OF_STATE.get(job.state, UNKNOWN), job.step, job.total_steps, detail, local_folder(job)
    )


class JobSource(RunSource):
    def __init__(self, store_of: Callable[[], JobStore]):
        """`store_of`: the API's store, built in its lifespan after this source is."""
        self.store_of = store_of

    def runs(self) -> list[RunInfo]:
        try:
            jobs, _ = self.store_of().list(limit=MAX_JOBS)
        except UnreadableRecord:  # the API's own reads repair such records; list the readable ones meanwhile
            jobs = self.store_of().unfinished()
        return [job_info(job) for job in jobs]

    def run(self, name: str) -> RunInfo:
        try:
            job = self.store_of().get(name)
        except UnreadableRecord:
            job = None
        if job is None:
            raise RunNotFound(name)
        return job_info(job)

    def metrics(self, name: str) -> list[dict[str, Any]]:
        store, after, steps = self.store_of(), 0, []
        while True:
            page = store.events(name, after, EVENTS_PAGE)
            steps += [event.data for event in page if event.type == "step"]
            if len(page) < EVENTS_PAGE:
                break
            after = page[-1].seq
        if not steps:
            from services.jobs.inspector.sources.folders import folder_metrics

            folder = self.run(name).folder
            return folder_metrics(folder) if folder else []
        return last_per_step(steps)
