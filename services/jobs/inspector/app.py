"""The inspector's ASGI app over one data source: served alone on loopback by `omrl inspect`, or mounted in the job
API under /inspect/ behind its token (services.jobs.inspector.gate)."""

from __future__ import annotations

from pathlib import Path

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from services.jobs.inspector import pages
from services.jobs.inspector.sources.base import RunNotFound, RunSource

TEMPLATES = Path(__file__).parent / "templates"


def templates() -> Jinja2Templates:
    # autoescape on every template: episode text is untrusted model output
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True, undefined=jinja2.StrictUndefined
    )
    env.filters["num"] = number
    return Jinja2Templates(env=env)


def number(value: object) -> object:
    """Six significant digits for a float (0.08, not 0.08000000000000002); anything else as it is."""
    return f"{value:.6g}" if isinstance(value, float) else value


def create_inspector(source: RunSource) -> FastAPI:
    app = FastAPI(title="OpenManus-RL inspector", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.source, app.state.templates = source, templates()
    app.include_router(pages.router)

    @app.exception_handler(RunNotFound)
    def no_run(request: Request, exc: RunNotFound) -> HTMLResponse:
        return missing(request, f"no run {exc.args[0]!r}")

    @app.exception_handler(FileNotFoundError)
    def no_file(request: Request, exc: FileNotFoundError) -> HTMLResponse:
        return missing(request, str(exc))

    return app


def missing(request: Request, message: str) -> HTMLResponse:
    return request.app.state.templates.TemplateResponse(
        request,
        "missing.html",
        {"base": request.scope.get("root_path", ""), "message": message, "refresh": False},
        status_code=404,
    )
