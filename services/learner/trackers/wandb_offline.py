"""A W&B run in offline mode (no account, no network): its files in the run folder's `trackers/wandb/offline-run-*`,
which `wandb sync` uploads later. The project is named after the run (`config.run`); metrics by step, the config,
and each episode table as a `wandb.Table` under `episodes`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import wandb

from services.common.config import TrainConfig
from services.learner.trackers.base import TRACKERS, Cell, Tracker, columns


@TRACKERS.register("wandb")
class WandbOffline(Tracker):
    name = "wandb"

    def __init__(self, config: TrainConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        settings = wandb.Settings(
            silent=True,
            # the learner's stdout and stderr stay its own (W&B would wrap them to copy the console)
            console="off",
            # no sampling process of W&B's own beside the learner: the cores are the learner's
            x_disable_stats=True,
            disable_git=True,
            save_code=False,
            x_save_requirements=False,
        )
        hooks = sys.excepthook, sys.exit
        self._run = wandb.init(
            project=config.run,
            name=config.run,
            dir=self.folder,
            mode="offline",
            reinit="create_new",
            settings=settings,
        )
        # W&B wraps both to see how the process ends; the learner's exit and error printing stay its own
        sys.excepthook, sys.exit = hooks

    def log_config(self, config: dict[str, Any]) -> None:
        self._run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_episodes(self, step: int, rows: list[dict[str, Cell]]) -> None:
        names = columns(rows)
        data = [[row.get(name) for name in names] for row in rows]
        # a column may hold an int in one row and a str in another, or None where a row lacks it
        self._run.log({"episodes": wandb.Table(columns=names, data=data, allow_mixed_types=True)}, step=step)

    def close(self) -> None:
        self._run.finish()
        wandb.teardown()  # stops W&B's service process now, not when the learner exits
