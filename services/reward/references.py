"""Reference answers: task index -> parsed ground truth, read from the run's task dataset (both splits: a task index
names its row whichever split it is in; generated splits hold disjoint indices, a user's own may repeat one, and then
its rows must agree). Read on the first lookup, so a service whose components need none never reads the files.

A row's `reward_model.ground_truth` (verl's layout) is JSON, as services.envs.datasets writes it (the env's
`task_info()`, e.g. {"answer": "7"}), or, as in verl's own files, the answer as plain text ("\\frac{1}{2}"). A task
without a row, or whose ground truth is empty, null or a broken JSON object, has no reference ("missing")."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from prometheus_client import CollectorRegistry

from services.common import metrics
from services.common.config import EnvConfig
from services.common.dataset_paths import SPLITS, dataset_dir

log = logging.getLogger(__name__)


def parse_ground_truth(raw: Any) -> Any:
    """The parsed ground truth of one row, None when there is none."""
    if not isinstance(raw, str):
        return raw  # a user's column of another type is structured already
    text = raw.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None if text[0] in "{[" else text
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return text  # the number as written: "0.50" stays 0.50 for exact match
    return value


def answers_of(truth: Any, key: str) -> list[str]:
    """The acceptable answers in a ground truth: its field `key` when it is an object, else the truth itself; a list
    gives several (a scorer takes the best match). Empty when there is none."""
    value = truth.get(key) if isinstance(truth, dict) else truth
    values = value if isinstance(value, list) else [value]
    return [v if isinstance(v, str) else json.dumps(v) for v in values if v is not None and v != ""]


def load_ground_truths(folder: Path) -> dict[int, Any]:
    truths: dict[int, Any] = {}
    for split in SPLITS:
        path = folder / f"{split}.parquet"
        if not path.exists():
            raise FileNotFoundError(
                f"reference answers: {path} not found (the reward service reads the run's task dataset, "
                "env.dataset or env.data_dir, which must be reachable from it)"
            )
        names = pq.read_schema(path).names
        if "task_index" not in names or "reward_model" not in names:
            raise ValueError(f"reference answers: {path} has no task_index or reward_model column")
        table = pq.read_table(path, columns=["task_index", "reward_model"])
        for task, model in zip(table.column("task_index").to_pylist(), table.column("reward_model").to_pylist()):
            truth = parse_ground_truth(model.get("ground_truth") if isinstance(model, dict) else None)
            if task in truths and truths[task] != truth:
                raise ValueError(f"reference answers: task {task} has rows with different ground truths in {folder}")
            truths[task] = truth
    return truths


class References:
    """The reference answers of one dataset folder, and the count of lookups that found none."""

    def __init__(self, folder: Path, *, metrics_registry: CollectorRegistry | None = None):
        self.folder = Path(folder)
        self._truths: dict[int, Any] | None = None
        self._lock = threading.Lock()  # scoring runs in worker threads, a batch each
        self._reported: set[str] = set()
        self._m_missing = metrics.counter(
            "reward",
            "reference_missing_total",
            "Trajectories a component scored without a reference answer (its missing fallback)",
            ["component"],
            registry=metrics_registry,
        )

    @classmethod
    def from_config(cls, env: EnvConfig, **kwargs: Any) -> References:
        return cls(dataset_dir(env), **kwargs)

    def watch(self, component: str) -> None:
        metrics.preset(self._m_missing, (component,))

    def answers(self, task_index: int, key: str) -> list[str]:
        return answers_of(self._load().get(task_index), key)

    def missing(self, component: str, task_index: int, fallback: str) -> None:
        """Counts a lookup that found no answer; logs the first one of each component."""
        self._m_missing.labels(component).inc()
        with self._lock:
            first = component not in self._reported
            self._reported.add(component)
        if first:
            log.warning(
                "reward component %s: task %d has no reference answer in %s (missing: %s); further ones are "
                "counted in omrl_reward_reference_missing_total only",
                component,
                task_index,
                self.folder,
                fallback,
            )

    def _load(self) -> dict[int, Any]:
        if self._truths is None:
            with self._lock:
                if self._truths is None:  # a failed read is not kept: the files may appear (the rollout writes them)
                    self._truths = load_ground_truths(self.folder)
                    log.info("reference answers of %d tasks read from %s", len(self._truths), self.folder)
        return self._truths
