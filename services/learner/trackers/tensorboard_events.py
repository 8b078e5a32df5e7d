"""TensorBoard event files in the run folder's `trackers/tensorboard` (`tensorboard --logdir` it): a scalar per
metric and step, the config as text at step 0, and each episode table as a markdown table, text at its step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from services.common.config import TrainConfig
from services.learner.trackers.base import TRACKERS, Cell, Tracker, columns


@TRACKERS.register("tensorboard")
class TensorboardEvents(Tracker):
    name = "tensorboard"

    def __init__(self, config: TrainConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._writer = SummaryWriter(log_dir=str(self.folder / "tensorboard"))

    def log_config(self, config: dict[str, Any]) -> None:
        text = json.dumps(config, indent=2)
        self._writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), global_step=0)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a step is seconds long: TensorBoard shows it now rather than at the writer's next flush

    def log_episodes(self, step: int, rows: list[dict[str, Cell]]) -> None:
        self._writer.add_text("episodes", markdown_table(rows), global_step=step)

    def close(self) -> None:
        self._writer.close()


def markdown_table(rows: list[dict[str, Cell]]) -> str:
    """`rows` as a markdown table; a cell's `|` and line breaks are escaped, so that each row stays one line."""
    names = columns(rows)
    lines = [_line([_escape(name) for name in names]), _line(["---"] * len(names))]
    lines += [_line([_escape(row.get(name)) for name in names]) for row in rows]
    return "\n".join(lines)


def _line(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _escape(value: Cell) -> str:
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")
