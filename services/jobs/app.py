"""The job API's FastAPI app: objects built in the lifespan and kept on app.state, one router per resource."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry, Gauge, Histogram, PlatformCollector, ProcessCollector

from services.common import metrics
from services.jobs.auth import forbid_unknown_query, require_token
from services.jobs.errors import validation_error
from services.jobs.launchers import LAUNCHERS, Launcher
from services.jobs.manager import JobManager
from services.jobs.middleware import BodySizeLimit, JsonDepthLimit, RequestMetrics
from services.jobs.progress import ProgressReader
from services.jobs.reconcile import Reconciler
from services.jobs.routers import episodes, events, health, jobs, logs
from services.jobs.routers import metrics as metrics_router
from services.jobs.settings import JobsSettings
from services.jobs.spec_policy import SpecPolicy
from services.jobs.store import JobStore

AUTH_RESPONSES = {
    401: {"description": "Missing or wrong bearer token"},
    413: {"description": "Request body over the size limit"},
}


@dataclass
class ApiMetrics:
    registry: CollectorRegistry
    jobs: Gauge
    request_seconds: Histogram

    @classmethod
    def create(cls) -> ApiMetrics:
        registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        return cls(
            registry,
            metrics.gauge("api", "jobs", "Jobs by state", ["state"], registry=registry),
            metrics.histogram(
                "api",
                "request_seconds",
                "Request latency (SSE: the whole stream)",
                ["method", "route", "status"],
                registry=registry,
            ),
        )


def build_launcher(settings: JobsSettings) -> Launcher:
    if settings.launcher == "local":
        return LAUNCHERS.create(
            "local",
            output_dir=settings.output_dir,
            max_jobs=settings.max_local_jobs,
            cancel_grace_s=settings.cancel_grace_s,
            max_restarts=settings.max_restarts,
            restart_delay_s=settings.restart_delay_s,
        )
    return LAUNCHERS.get("kubernetes").from_settings(settings)


def create_app(
    settings: JobsSettings | None = None, launcher: Launcher | None = None, progress: ProgressReader | None = None
) -> FastAPI:
    settings = settings or JobsSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        store = JobStore(settings.db)
        chosen = launcher or build_launcher(settings)
        reader = progress or ProgressReader(settings.redis_timeout_s)
        app.state.store, app.state.manager = store, JobManager(store, chosen, reader)
        app.state.reconciler = Reconciler(
            app.state.manager,
            settings.poll_interval_s,
            settings.reconcile_max_age_s,
            backoff_s=settings.reconcile_backoff_s,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(app.state.reconciler.supervise(stop))
        try:
            yield
        finally:
            stop.set()
            await task  # the pass in flight finishes before the store closes
            chosen.close()
            reader.close()
            store.close()

    public_docs = settings.public_docs
    app = FastAPI(
        title="OpenManus-RL job API",
        version="1",
        lifespan=lifespan,
        description="Submit, follow and cancel RL training jobs. Every route but /healthz and /readyz "
        "needs `Authorization: Bearer <token>`. The trajectory inspector's pages are under /inspect/ (a browser "
        "logs in once with `?token=`).",
        openapi_url="/openapi.json" if public_docs else None,
        docs_url="/docs" if public_docs else None,
        redoc_url=None,
    )
    app.state.settings, app.state.token = settings, settings.resolve_token()
    app.state.spec_policy = SpecPolicy.from_settings(settings)
    app.state.api_metrics = ApiMetrics.create()
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_middleware(JsonDepthLimit, max_depth=settings.max_json_depth)  # inside the size limit: reads bounded bodies
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, histogram=app.state.api_metrics.request_seconds)  # outermost: sees 413s too
    authed = [Depends(require_token), Depends(forbid_unknown_query)]
    app.include_router(health.router)
    for router in (jobs.router, events.router, logs.router, episodes.router, metrics_router.router):
        app.include_router(router, dependencies=authed, responses=AUTH_RESPONSES)
    if not public_docs:
        _serve_openapi_with_token(app, authed)
    _mount_inspector(app)
    return app


def _mount_inspector(app: FastAPI) -> None:
    """The trajectory inspector under /inspect/, behind the API's token: the jobs of its store, and the episodes of
    those whose run folder is on this machine."""
    from services.jobs.inspector.app import create_inspector
    from services.jobs.inspector.gate import TokenGate
    from services.jobs.inspector.sources.jobs import JobSource

    inspector = create_inspector(JobSource(lambda: app.state.store))
    app.mount("/inspect", TokenGate(inspector, app.state.token))


def _serve_openapi_with_token(app: FastAPI, dependencies: list) -> None:
    @app.get("/openapi.json", include_in_schema=False, dependencies=dependencies)
    def openapi() -> dict:
        return app.openapi()
