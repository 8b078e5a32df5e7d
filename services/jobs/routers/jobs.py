"""/v1/jobs: submit, list, inspect and cancel jobs."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import TypeVar

from fastapi import APIRouter, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError

from services.jobs.launchers import SpecRejected
from services.jobs.manager import JobConflict, JobManager, JobNotFound
from services.jobs.models import JOB_ID_PATTERN, Job, JobPage, JobState
from services.jobs.spec import JobSpec
from services.jobs.store import UnreadableRecord

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
JobId = Path(pattern=JOB_ID_PATTERN, description="Job id, as returned by the submit call")
NOT_FOUND = {404: {"description": "No such job"}}
LAUNCHER_DOWN = {502: {"description": "The launcher's backend (e.g. the Kubernetes API) failed; retry"}}
MAX_REPAIRS = 20
T = TypeVar("T")


def manager(request: Request) -> JobManager:
    return request.app.state.manager


@contextmanager
def launcher_errors():
    """A failing launcher backend is a bad gateway, not a bug of this API."""
    try:
        yield
    except (HTTPException, JobNotFound, JobConflict, UnreadableRecord):
        raise
    except Exception as exc:
        raise HTTPException(502, f"launcher failed: {type(exc).__name__}: {exc}"[:2000]) from exc


def get_job(request: Request, job_id: str) -> Job:
    try:
        return repairing(request, lambda: manager(request).get(job_id))
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None


def repairing(request: Request, read: Callable[[], T]) -> T:
    """`read()`, after replacing any unreadable record it meets with one that says why."""
    for _ in range(MAX_REPAIRS):
        try:
            return read()
        except UnreadableRecord as exc:
            manager(request).repair(exc)
    return read()


@router.post(
    "",
    status_code=201,
    response_model=Job,
    summary="Submit a job",
    responses={
        400: {"description": "The body is not JSON, or nests deeper than the API's limit"},
        422: {"description": "Invalid spec; `detail[].loc` names the field"},
    },
)
def submit(request: Request, spec: JobSpec) -> Job:
    try:
        return manager(request).submit(request.app.state.spec_policy.apply(spec))
    except SpecRejected as exc:
        kind = getattr(exc, "kind", "launcher_rejected")
        raise RequestValidationError(
            [{"type": kind, "loc": ("body", *exc.loc), "msg": exc.message, "input": None}]
        ) from None


@router.get("", response_model=JobPage, summary="List jobs, newest first")
def list_jobs(
    request: Request,
    state: list[JobState] | None = Query(None, description="Only jobs in these states"),
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=1_000_000),
) -> JobPage:
    jobs, total = repairing(request, lambda: manager(request).store.list(state, limit, offset))
    return JobPage(jobs=jobs, total=total)


@router.get(
    "/{job_id}",
    response_model=Job,
    summary="A job: state, step, latest metrics, policy version, error",
    responses=NOT_FOUND,
)
def read_job(request: Request, job_id: str = JobId) -> Job:
    return get_job(request, job_id)


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=Job,
    summary="Cancel a job: a queued one at once, a running one once its processes are gone",
    responses={**NOT_FOUND, **LAUNCHER_DOWN, 409: {"description": "The job has already finished"}},
)
def cancel(request: Request, job_id: str = JobId) -> Job:
    try:
        with launcher_errors():
            return repairing(request, lambda: manager(request).cancel(job_id))
    except JobNotFound:
        raise HTTPException(404, f"no job {job_id}") from None
    except JobConflict as exc:
        raise HTTPException(409, str(exc)) from None
