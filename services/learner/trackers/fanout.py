"""Every tracker a run's config names, behind one object the learner calls: a tracker that fails, when it starts or
on any call, is logged once (a warning naming it and the error) and dropped, so a tracker never stops training and
never raises to its caller. With no tracker chosen the calls do nothing and no tracker library is imported."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.common.config import TrainConfig
from services.learner.trackers.base import TRACKERS, Cell, Tracker

log = logging.getLogger(__name__)


class Trackers:
    """Calls every tracker in turn, from one thread."""

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self._trackers = list(trackers)

    @classmethod
    def from_config(cls, config: TrainConfig, run_dir: Path | None = None) -> Trackers:
        """The trackers of `config.logging.trackers`, writing under `run_dir` (default: the config's run folder)."""
        run_dir = config.run_dir if run_dir is None else run_dir
        started = []
        for name in config.logging.trackers:
            try:
                started.append(TRACKERS.create(name, config, run_dir))
            except Exception as exc:
                _warn_dropped(name, "start", exc)
        return cls(started)

    @property
    def names(self) -> list[str]:
        """The trackers still running."""
        return [tracker.name for tracker in self._trackers]

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._call("log_config", dict(config))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """The finite numbers of `metrics` (`finite_numbers`), under the names given."""
        numbers_only = finite_numbers(metrics)
        if numbers_only:
            self._call("log_metrics", step, numbers_only)

    def log_episodes(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A table of sample episodes, a row per episode, its values made storable (`plain_row`)."""
        table = [plain_row(row) for row in rows]
        if table:
            self._call("log_episodes", step, table)

    def close(self) -> None:
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as exc:
                _warn_dropped(tracker.name, "close", exc)

    def _call(self, method: str, *args: Any) -> None:
        for tracker in list(self._trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:
                _warn_dropped(tracker.name, method, exc)
                self._trackers.remove(tracker)
                try:
                    tracker.close()
                except Exception:
                    pass  # already reported: its failure above is the one to read


def _warn_dropped(name: str, stage: str, exc: Exception) -> None:
    log.warning(
        "tracker %s failed at %s and is dropped (training goes on): %s: %s", name, stage, type(exc).__name__, exc
    )


def finite_numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The int, float and bool values of `metrics` that are finite, as floats; strings, lists, dicts, None, NaN and
    infinities are left out."""
    kept = {}
    for key, value in metrics.items():
        number = _finite(value)
        if number is not None:
            kept[key] = number
    return kept


def plain_row(row: Mapping[str, Any]) -> dict[str, Cell]:
    """`row` with the values every tracker can store: str, bool, int and finite floats as they are, None for NaN and
    infinities (JSON has neither), the str() of anything else."""
    return {str(key): _cell(value) for key, value in row.items()}


def _finite(value: Any) -> float | None:
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError):  # an int past float's range
        return None
    return number if math.isfinite(number) else None


def _cell(value: Any) -> Cell:
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return _finite(value)
    return str(value)
