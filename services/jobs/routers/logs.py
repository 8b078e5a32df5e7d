"""/v1/jobs/{id}/logs: the tail of one of the job's service logs."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import PlainTextResponse

from services.jobs.routers.jobs import LAUNCHER_DOWN, NOT_FOUND, JobId, get_job, launcher_errors

router = APIRouter(prefix="/v1/jobs", tags=["logs"])


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={**NOT_FOUND, **LAUNCHER_DOWN},
    summary="Last lines of a service's log (local: files; kubernetes: the pods)",
)
def logs(
    request: Request,
    job_id: str = JobId,
    service: Literal["supervisor", "envs", "reward", "rollout", "learner"] = "learner",
    tail: int = Query(200, ge=1, le=10000),
) -> str:
    job = get_job(request, job_id)
    if not job.launcher_info:
        return ""
    with launcher_errors():
        return request.app.state.manager.launcher.logs(job.id, job.launcher_info, service, tail)
