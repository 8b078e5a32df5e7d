"""/v1/jobs/{id}/episodes: a step's recorded episodes (services/learner/episodes.py), read from the job's run folder
where that is on the API's machine (the local launcher's); a Kubernetes job's folder is on its volume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request

from services.jobs.routers.jobs import NOT_FOUND, JobId, get_job

router = APIRouter(prefix="/v1/jobs", tags=["episodes"])


@router.get(
    "/{job_id}/episodes",
    responses={**NOT_FOUND, 409: {"description": "The job's run folder is not on the API's machine"}},
    summary="A step's recorded episodes with what the learner computed per token (default: the last step)",
)
def episodes(request: Request, job_id: str = JobId, step: int | None = Query(None, ge=1)) -> dict[str, Any]:
    from services.learner.episodes import read_step, recorded_steps

    job = get_job(request, job_id)
    path = job.launcher_info.get("run_dir") if job.launcher_info else None
    folder = Path(path) if isinstance(path, str) else None
    if folder is None or not folder.is_dir():
        raise HTTPException(409, f"job {job_id}'s run folder is not on the API's machine (a Kubernetes job's volume)")
    steps = recorded_steps(folder)
    if not steps:
        raise HTTPException(404, f"job {job_id} has no recorded episodes yet")
    step = steps[-1] if step is None else step
    try:
        rows = read_step(folder, step)
    except FileNotFoundError as exc:
        raise HTTPException(404, str(exc)) from None
    return {"step": step, "steps": steps, "episodes": rows}
