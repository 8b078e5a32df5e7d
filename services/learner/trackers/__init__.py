"""Experiment trackers (`logging.trackers`): where a run's metrics, config and sample episodes go besides Prometheus.

- `base`: `Tracker`, the `TRACKERS` registry, and how to add a tracker.
- `fanout`: `Trackers`, every chosen tracker behind one object; the learner calls only this.
- one module per tracker: `jsonl_files`, `tensorboard_events`, `mlflow_run`, `wandb_offline`.

Importing this package loads no tracker library: each loads with its module, when a run chooses it."""

from services.learner.trackers.base import TRACKERS, Tracker
from services.learner.trackers.fanout import Trackers

__all__ = ["TRACKERS", "Tracker", "Trackers"]
