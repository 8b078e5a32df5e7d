"""How the CLI shows jobs and their events."""

from __future__ import annotations

import sys
import time
from datetime import datetime
from typing import Any


def _age(stamp: str | None) -> str:
    if not stamp:
        return "-"
    seconds = max(0.0, time.time() - datetime.fromisoformat(stamp).timestamp())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def job_table(jobs: list[dict[str, Any]], color: bool | None = None) -> str:
    """`omrl list`: aligned columns (rich), coloured by state at a terminal."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    color = sys.stdout.isatty() if color is None else color
    table = Table(box=None, pad_edge=False, header_style="bold" if color else "")
    for name, justify in (("ID", "left"), ("STATE", "left"), ("STEP", "right"), ("REWARD", "right")):
        table.add_column(name, justify=justify, no_wrap=True)
    for name in ("SUCCESS", "AGE", "NAME"):
        table.add_column(name, justify="right" if name != "NAME" else "left", no_wrap=True)
    for job in jobs:
        m = job.get("metrics") or {}
        success = m.get("success_rate")
        cells = (
            job["id"],
            job["state"],
            f"{job['step']}/{job['total_steps']}",
            _num(m.get("reward_mean"), "+.3f"),
            _num(100 * success, ".0f") + "%" if isinstance(success, (int, float)) else "-",
            _age(job["created_at"]),
            job["name"],
        )  # Text, not markup: a job's name is the user's text
        table.add_row(*(Text(str(c), style=STATE_STYLES.get(c, "") if i == 1 else "") for i, c in enumerate(cells)))
    console = Console(width=400, no_color=not color, force_terminal=color, highlight=False)
    with console.capture() as capture:
        console.print(table)
    return "\n".join(line.rstrip() for line in capture.get().splitlines())


STATE_STYLES = {"succeeded": "green", "failed": "red", "running": "cyan", "cancelled": "yellow"}


def job_status(job: dict[str, Any]) -> str:
    m = job.get("metrics") or {}
    lines = [
        f"job       {job['id']} ({job['name']})",
        f"state     {job['state']}",
        f"step      {job['step']}/{job['total_steps']}  policy v{_or_dash(job.get('policy_version'))}",
        f"created   {job['created_at']}  started {job.get('started_at') or '-'}  "
        f"finished {job.get('finished_at') or '-'}",
    ]
    if m:
        lines.append(
            "metrics   "
            + "  ".join(
                f"{k} {_num(m.get(k), '.4g')}"
                for k in ("reward_mean", "success_rate", "loss", "approx_kl", "step_seconds")
                if k in m
            )
        )
    if job.get("recovered_at"):
        lines.append(f"recovered {job['recovered_at']} (the API restarted while the job ran)")
    if job.get("error"):
        lines.append(f"error     {job['error']}")
    return "\n".join(lines)


def progress_bar(step: int, total: int, width: int = 20) -> str:
    done = int(width * step / total) if total else width
    return "[" + "#" * done + "." * (width - done) + "]"


def event_line(event: dict[str, Any], total_steps: int) -> str:
    data, kind = event["data"], event["type"]
    if kind == "step":
        step, secs = int(data.get("step", 0)), data.get("step_seconds")
        eta = f" eta {max(0, total_steps - step) * secs:.0f}s" if isinstance(secs, (int, float)) else ""
        success = data.get("success_rate")
        return (
            f"step {step}/{total_steps} {progress_bar(step, total_steps)}"
            f" reward {_num(data.get('reward_mean'), '+.3f')}"
            f" success {_num(100 * success, '.0f') if isinstance(success, (int, float)) else '-'}%"
            f" kl {_num(data.get('approx_kl'), '.4f')} {_num(secs, '.1f')}s/step"
            f" v{_or_dash(data.get('policy_version'))}{eta}"
        )
    if kind == "state":
        return f"state: {data['state']}" + (f" ({data['error']})" if data.get("error") else "")
    if kind == "alert":
        return f"alert: {data.get('message', data)}"
    return f"  {data.get('message', data)}"


class PlainFollow:
    """`omrl follow` into a pipe or file: one line per event."""

    def __init__(self, total_steps: int):
        self.total = total_steps

    def event(self, event: dict[str, Any]) -> None:
        print(event_line(event, self.total), flush=True)

    def end(self, job_id: str, state: str) -> None:
        print(f"job {job_id} {state}", flush=True)

    def close(self) -> None:
        pass


class LiveFollow:
    """`omrl follow` at a terminal: start-up stages, kept step lines and a live step bar (rich)."""

    def __init__(self, total_steps: int):
        from services.cli.live import LiveView

        self.live = LiveView(total_steps)

    def event(self, event: dict[str, Any]) -> None:
        data, kind = event["data"], event["type"]
        if kind == "step":
            self.live.step(data)
        elif kind == "state":
            self.live.stage(f"state: {data['state']}" + (f" ({data['error']})" if data.get("error") else ""))
        elif kind == "alert" or data.get("stage") in ("restarting", "restarted"):  # e.g. a task quarantined
            self.live.notice(str(data.get("message")))
        elif "stage" in data:
            self.live.stage(str(data.get("message")))
        else:
            self.live.line(f"  {data.get('message', data)}", style="dim")

    def end(self, job_id: str, state: str) -> None:
        self.live.close()
        self.live.line(f"job {job_id} {state}", style="bold green" if state == "succeeded" else "bold red")

    def close(self) -> None:
        self.live.close()


def follow_view(total_steps: int) -> PlainFollow | LiveFollow:
    return LiveFollow(total_steps) if sys.stdout.isatty() else PlainFollow(total_steps)
