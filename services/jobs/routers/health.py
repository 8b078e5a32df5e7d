"""Liveness and readiness: the only routes without the token."""

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: the job store answers and the reconcile loop runs",
    responses={503: {"description": "The job store does not answer, or no reconcile pass finished lately"}},
)
def readyz(request: Request):
    try:
        request.app.state.store.ping()
    except Exception as exc:
        return JSONResponse({"status": "unavailable", "detail": str(exc)}, status_code=503)
    ready, why = request.app.state.reconciler.health()
    if not ready:
        return JSONResponse({"status": "unavailable", "detail": why}, status_code=503)
    return {"status": "ok"}
