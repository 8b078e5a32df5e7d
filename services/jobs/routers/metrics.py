"""/metrics: the API's Prometheus metrics (jobs by state, request latency)."""

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.jobs.models import STATES

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
def metrics(request: Request) -> Response:
    state = request.app.state
    counts = state.store.count_by_state()
    for name in STATES:
        state.api_metrics.jobs.labels(name).set(counts.get(name, 0))
    return Response(generate_latest(state.api_metrics.registry), media_type=CONTENT_TYPE_LATEST)
