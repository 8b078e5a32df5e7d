"""A run's progress for a person at a terminal (rich): start-up stages as they happen, one kept line per
step, and a live bottom line with the step bar, reward, success, KL, step time and ETA. Used by
`omrl follow` and `python -m services.launcher train`; without a terminal both print plain lines instead."""

from __future__ import annotations

from statistics import mean
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text


def _num(value: Any, fmt: str, scale: float = 1.0) -> str:
    return format(value * scale, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def eta_seconds(step: int, total: int, step_seconds: list[float]) -> float | None:
    """Remaining steps times the mean of the last (up to) 5 step times."""
    return max(0, total - step) * mean(step_seconds[-5:]) if step_seconds else None


def step_stats(m: dict[str, Any], eta: float | None) -> str:
    return (
        f"reward {_num(m.get('reward_mean'), '+.3f')}  success {_num(m.get('success_rate'), '.0f', 100)}%  "
        f"kl {_num(m.get('approx_kl'), '.4f')}  {_num(m.get('step_seconds'), '.1f')}s/step  "
        f"eta {duration(eta) if eta is not None else '-'}{filtered_note(m)}"
    )


def filtered_note(m: dict[str, Any]) -> str:
    """The step's groups that dynamic sampling dropped, shown only when there were some."""
    return f"  filtered {m['groups_filtered']}" if m.get("groups_filtered") else ""


class LiveView:
    """Call `stage`, `step`, `line` as things happen; `close` (or leave the `with` block) at the end."""

    def __init__(self, total_steps: int, console: Console | None = None):
        self.console = console or Console(highlight=False)
        self.total = total_steps
        self.step_seconds: list[float] = []
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.task = self.progress.add_task("starting", total=total_steps or None, stats="")
        self.progress.start()

    def __enter__(self) -> LiveView:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stage(self, text: str) -> None:
        """A start-up event: kept above the live line, and shown on it until the next one."""
        self.console.print(Text("  " + text, style="cyan"))
        if not self.progress.tasks[self.task].completed:
            self.progress.update(self.task, description=text if len(text) <= 60 else text[:57] + "...")

    def notice(self, text: str) -> None:
        """Something going wrong that the run handles (a service restarting): kept above the live line in
        yellow, and shown on it until the next step."""
        self.console.print(Text("  " + text, style="yellow"))
        self.progress.update(self.task, description=text if len(text) <= 60 else text[:57] + "...")

    def line(self, text: str, style: str | None = None) -> None:
        self.console.print(Text(text, style=style or ""))

    def step(self, m: dict[str, Any]) -> None:
        step = int(m.get("step") or 0)
        if isinstance(m.get("step_seconds"), (int, float)):
            self.step_seconds.append(float(m["step_seconds"]))
        stats = step_stats(m, eta_seconds(step, self.total, self.step_seconds))
        mismatch = f"  mismatch {_num(m['mismatch_kl'], '.1e')}" if "mismatch_kl" in m else ""
        self.console.print(Text(f"step {step}/{self.total}  {stats}{mismatch}  policy v{m.get('policy_version', '-')}"))
        self.progress.update(self.task, completed=step, description="training", stats=stats)

    def close(self) -> None:
        self.progress.stop()
