"""/v1/jobs/{id}/events: the job's state changes, step metrics and launcher messages, in order.

One endpoint, two forms: a page of events after a cursor (JSON, for polling), or with `follow=true` a
server-sent event stream (`curl -N`, the CLI) that ends when the job has finished. Each SSE message's
`id` is the event's seq, so a client resumes with `after` or the Last-Event-ID header."""

from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Header, Query, Request
from sse_starlette.sse import EventSourceResponse

from services.jobs.models import EventPage
from services.jobs.routers.jobs import NOT_FOUND, JobId, get_job

router = APIRouter(prefix="/v1/jobs", tags=["events"])
PAGE = 500


@router.get(
    "/{job_id}/events",
    response_model=EventPage,
    summary="Follow a job's events (JSON page or SSE)",
    responses={
        **NOT_FOUND,
        200: {
            "description": "A page of events, or with follow=true an event stream",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
    },
)
async def events(
    request: Request,
    job_id: str = JobId,
    after: int = Query(0, ge=0, le=2**53),
    follow: bool = Query(False, description="Stream events (SSE) until the job has finished"),
    last_event_id: str | None = Header(None),
):
    page = await asyncio.to_thread(read_page, request, job_id, after)
    if not follow:
        return page
    if last_event_id and last_event_id.isdigit():
        after = max(after, int(last_event_id))
    return EventSourceResponse(stream(request, job_id, after), ping=15)


def read_page(request: Request, job_id: str, after: int) -> EventPage:
    store = request.app.state.store
    job = get_job(request, job_id)  # before the events: a finished job has all of its events stored
    events = store.events(job_id, after, PAGE)
    next_after = events[-1].seq if events else after
    return EventPage(
        events=events, next_after=next_after, job_state=job.state, finished=job.finished and len(events) < PAGE
    )


async def stream(request: Request, job_id: str, after: int):
    interval = min(request.app.state.settings.poll_interval_s, 0.5)
    while True:
        page = await asyncio.to_thread(read_page, request, job_id, after)
        for event in page.events:
            yield {"id": str(event.seq), "event": event.type, "data": event.model_dump_json()}
        after = page.next_after
        if page.finished:
            yield {"event": "end", "data": json.dumps({"job_state": page.job_state})}
            return
        if not page.events:
            await asyncio.sleep(interval)
