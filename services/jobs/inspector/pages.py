"""The inspector's pages: the run list, a run's curves and recorded steps, the comparison of runs, a step's episodes
and one episode (transcript, reward breakdown, tokens). Read-only: every route is a GET."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from services.jobs.inspector import charts, episode_view
from services.jobs.inspector.sources.base import RunSource

router = APIRouter()


def render(request: Request, template: str, **context: Any) -> HTMLResponse:
    context.setdefault("refresh", False)
    return request.app.state.templates.TemplateResponse(
        request, template, {"base": request.scope.get("root_path", ""), **context}
    )


def source(request: Request) -> RunSource:
    return request.app.state.source


@router.get("/", response_class=HTMLResponse)
def run_list(request: Request) -> HTMLResponse:
    runs = source(request).runs()
    return render(request, "runs.html", runs=runs, refresh=any(r.live for r in runs))


@router.get("/compare", response_class=HTMLResponse)
def compare(request: Request, run: list[str] = Query(default=[])) -> HTMLResponse:
    src = source(request)
    infos = [src.run(name) for name in dict.fromkeys(run)]
    figures = charts.run_charts({info.name: src.metrics(info.name) for info in infos})
    return render(request, "compare.html", runs=infos, charts=figures, refresh=any(i.live for i in infos))


@router.get("/runs/{name}", response_class=HTMLResponse)
def run_page(request: Request, name: str) -> HTMLResponse:
    src = source(request)
    info = src.run(name)
    metrics = src.metrics(name)
    figures = charts.run_charts({name: metrics})
    return render(
        request,
        "run.html",
        run=info,
        charts=figures,
        steps=src.steps(name),
        last=metrics[-1] if metrics else {},
        refresh=info.live,
    )


@router.get("/runs/{name}/steps/{step}", response_class=HTMLResponse)
def step_page(
    request: Request,
    name: str,
    step: int,
    success: str = Query("", pattern="^(|true|false)$"),
    env: str = "",
    stop_reason: str = "",
    errors: bool = False,
    sort: str = Query("", pattern="^(|reward|advantage_mean)$"),
    ascending: bool = False,
) -> HTMLResponse:
    src = source(request)
    info, rows = src.run(name), src.episodes(name, step)
    filters = episode_view.Filters(success, env, stop_reason, errors)
    picked = episode_view.select(rows, filters, sort, ascending)
    return render(
        request,
        "step.html",
        run=info,
        step=step,
        steps=src.steps(name),
        episodes=picked,
        total=len(rows),
        filters=filters,
        sort=sort,
        ascending=ascending,
        envs=episode_view.choices(rows, "env"),
        stop_reasons=episode_view.choices(rows, "stop_reason"),
        refresh=info.live,
    )


@router.get("/runs/{name}/steps/{step}/episodes/{trajectory_id}", response_class=HTMLResponse)
def episode_page(
    request: Request,
    name: str,
    step: int,
    trajectory_id: str,
    mode: str = Query("loss_mask", pattern="^(" + "|".join(episode_view.TOKEN_MODES) + ")$"),
) -> HTMLResponse:
    src = source(request)
    info = src.run(name)
    row = next((r for r in src.episodes(name, step) if r["trajectory_id"] == trajectory_id), None)
    if row is None:
        raise HTTPException(404, f"no episode {trajectory_id} in step {step} of {name}")
    summary = episode_view.summaries([row])[0]
    return render(
        request,
        "episode.html",
        run=info,
        step=step,
        row=row,
        summary=summary,
        components=episode_view.reward_components(row),
        tokens=episode_view.tokens(row, mode),
        mode=mode,
        modes=episode_view.TOKEN_MODES,
    )
