"""Line charts of per-step metrics as geometry for an inline SVG (templates/_chart.html draws it): computed here,
on the server, so the page needs no script and a test can read the numbers back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward_mean",)),
    ("success rate", ("success_rate",)),
    ("KL", ("approx_kl", "kl")),
    ("response length (tokens)", ("response_len_mean",)),
    ("step time (s)", ("step_seconds",)),
)
"""(title, keys): a chart shows the first key a run has."""
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
WIDTH, HEIGHT, LEFT, RIGHT, TOP, BOTTOM = 540, 220, 56, 12, 12, 28  # two charts side by side in 1200 px


@dataclass
class Point:
    x: float
    y: float
    step: int
    value: float


@dataclass
class Series:
    name: str
    key: str
    colour: str
    points: list[Point]

    @property
    def path(self) -> str:
        return " ".join(f"{p.x:.1f},{p.y:.1f}" for p in self.points)


@dataclass
class Chart:
    title: str
    series: list[Series] = field(default_factory=list)
    y_ticks: list[tuple[float, str]] = field(default_factory=list)
    x_ticks: list[tuple[float, str]] = field(default_factory=list)
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def empty(self) -> bool:
        return not any(s.points for s in self.series)


def values(metrics: list[dict[str, Any]], keys: tuple[str, ...]) -> tuple[str, list[tuple[int, float]]]:
    """(the key used, [(step, value)]) of the first key with a finite value; non-finite values are left out."""
    for key in keys:
        pairs = [(int(m["step"]), float(m[key])) for m in metrics if _finite(m.get(key))]
        if pairs:
            return key, pairs
    return keys[0], []


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def label(value: float) -> str:
    return f"{value:.4g}"


def line_chart(title: str, runs: dict[str, tuple[str, list[tuple[int, float]]]]) -> Chart:
    """One chart, a line per run: `runs` maps a run's name to (key, [(step, value)])."""
    every = [pair for _, pairs in runs.values() for pair in pairs] or [(0, 0.0)]
    x0, x1 = min(s for s, _ in every), max(s for s, _ in every)
    y0, y1 = min(v for _, v in every), max(v for _, v in every)
    if y0 == y1:  # a flat line: the axis from 0 to it (0 to 1 for a line at 0: a success rate that stays 0)
        y0, y1 = min(y0, 0.0), max(y1, 0.0)
        y1 = y1 if y1 > y0 else 1.0
    inner_w, inner_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: int) -> float:
        return LEFT + (inner_w * (step - x0) / (x1 - x0) if x1 > x0 else inner_w / 2)

    def y(value: float) -> float:
        return TOP + inner_h * (1 - (value - y0) / (y1 - y0))

    chart = Chart(title)
    for i, (name, (key, pairs)) in enumerate(runs.items()):
        chart.series.append(Series(name, key, COLOURS[i % len(COLOURS)], [Point(x(s), y(v), s, v) for s, v in pairs]))
    chart.y_ticks = [(y(v), label(v)) for v in (y0 + (y1 - y0) * k / 4 for k in range(5))]
    chart.x_ticks = [(x(s), str(s)) for s in sorted({x0, (x0 + x1) // 2, x1})]
    return chart


def run_charts(metrics_of: dict[str, list[dict[str, Any]]]) -> list[Chart]:
    """A chart per metric of METRICS, with a line per run."""
    return [line_chart(title, {name: values(m, keys) for name, m in metrics_of.items()}) for title, keys in METRICS]
