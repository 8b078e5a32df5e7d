"""JSON lines in the run folder's `trackers/`, read with no tracker library: `metrics.jsonl` (a line per step:
step, time, metrics), `episodes.jsonl` (a line per table: step, time, rows) and `config.json`. A restarted run
appends: a step it trains again has two lines, the later one from after the restart."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from services.common.config import TrainConfig
from services.learner.trackers.base import TRACKERS, Cell, Tracker


@TRACKERS.register("jsonl")
class JsonlFiles(Tracker):
    name = "jsonl"

    def __init__(self, config: TrainConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._metrics = (self.folder / "metrics.jsonl").open("a", encoding="utf-8")
        self._episodes = (self.folder / "episodes.jsonl").open("a", encoding="utf-8")

    def log_config(self, config: dict[str, Any]) -> None:
        path = self.folder / "config.json"
        partial = path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(config, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(partial, path)  # a reader never sees half a file

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        _write_line(self._metrics, {"step": step, "time": time.time(), "metrics": metrics})

    def log_episodes(self, step: int, rows: list[dict[str, Cell]]) -> None:
        _write_line(self._episodes, {"step": step, "time": time.time(), "rows": rows})

    def close(self) -> None:
        self._metrics.close()
        self._episodes.close()


def _write_line(file: IO[str], event: dict[str, Any]) -> None:
    # flushed line by line: a run that dies keeps every step it logged, and `tail -f` follows it
    file.write(json.dumps(event, allow_nan=False, separators=(",", ":")) + "\n")
    file.flush()
