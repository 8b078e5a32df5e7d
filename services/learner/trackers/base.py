"""What every experiment tracker does: receive the run's config once, each step's metrics, and now and then a table
of sample episodes, and write them where its own tools read them, under the run folder's `trackers/`. A `Tracker`
registered by name in `TRACKERS` (the config's `logging.trackers`).

A new tracker is a module of this package with a `Tracker` subclass under `@TRACKERS.register("name")`, and one
`register_lazy` line below, so that its library is imported only by a run that chooses it."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any

from services.common.config import TrainConfig
from services.common.registry import Registry

Cell = str | int | float | bool | None
"""A value of an episode table's cell."""


class Tracker(abc.ABC):
    """One tracker of one run: built as `cls(config, run_dir)` (its registry entry) when training starts, called from
    one thread, closed once at the end. Its arguments are already clean (`fanout.Trackers` makes them so): metrics
    are finite floats, rows flat dicts of `Cell`s, which a tracker must not modify. A tracker raises what goes wrong
    rather than going on half broken: the fan-out warns once and drops it."""

    name: str = "base"

    def __init__(self, config: TrainConfig, run_dir: Path) -> None:
        self.folder = run_dir / "trackers"
        self.folder.mkdir(parents=True, exist_ok=True)

    @abc.abstractmethod
    def log_config(self, config: dict[str, Any]) -> None:
        """The run's config, as `TrainConfig.model_dump(mode="json")` gives it."""

    @abc.abstractmethod
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics, under the names Prometheus shows (e.g. `reward_mean`, `time/score_s`)."""

    @abc.abstractmethod
    def log_episodes(self, step: int, rows: list[dict[str, Cell]]) -> None:
        """A table of sample episodes at `step`, a row per episode (rows may lack some columns)."""

    def close(self) -> None:
        """Writes out what is buffered and releases files and processes."""


def columns(rows: list[dict[str, Cell]]) -> list[str]:
    """Every key of `rows`, in the order it first appears."""
    return list(dict.fromkeys(key for row in rows for key in row))


TRACKERS: Registry[Tracker] = Registry("experiment tracker")
TRACKERS.register_lazy("jsonl", "services.learner.trackers.jsonl_files")
TRACKERS.register_lazy("tensorboard", "services.learner.trackers.tensorboard_events")
TRACKERS.register_lazy("mlflow", "services.learner.trackers.mlflow_run")
TRACKERS.register_lazy("wandb", "services.learner.trackers.wandb_offline")
