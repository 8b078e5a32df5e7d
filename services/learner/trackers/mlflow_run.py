"""An MLflow run per training run, in an experiment named after it (`config.run`): the config's fields as params
(dotted names) and as the artifact `config.json`, metrics by step, and each episode table as the JSON artifact
`episodes/step_<step>.json` in `mlflow.log_table`'s layout (columns, data; log_table itself needs pandas).

The store is `logging.mlflow_tracking_uri`, else a SQLite database in the run folder, `trackers/mlflow/mlflow.db`,
with the artifacts beside it in `trackers/mlflow/artifacts` (`mlflow ui --backend-store-uri sqlite:///...` shows
it): MLflow 3 refuses its file store unless told to allow it, that store being in maintenance mode."""

from __future__ import annotations

import json
import os
import posixpath
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from services.common.config import TrainConfig
from services.learner.trackers.base import TRACKERS, Cell, Tracker, columns

# MLflow's limits (mlflow.utils.validation): a longer param value or name, or a larger batch, is refused
MAX_PARAM_CHARS = 6000
MAX_NAME_CHARS = 250
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

T = TypeVar("T")


@TRACKERS.register("mlflow")
class MlflowRun(Tracker):
    name = "mlflow"

    def __init__(self, config: TrainConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        uri, artifacts = config.logging.mlflow_tracking_uri, None
        if not uri:
            store = (self.folder / "mlflow").resolve()
            store.mkdir(exist_ok=True)
            # a database store puts artifacts in ./mlruns of the current folder unless the experiment names a place
            uri, artifacts = f"sqlite:///{store / 'mlflow.db'}", (store / "artifacts").as_uri()
        elif uri.startswith(("http:", "https:")):
            # a server that does not answer would hold a training step for minutes (by default MLflow retries a
            # call 7 times, waiting up to 120 s each); the fan-out drops the tracker after its first failure
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(config.run)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self._client.create_experiment(config.run, artifact_location=artifacts)
        self._run_id = self._client.create_run(experiment_id, run_name=config.run).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        params = [Param(name, value) for name, value in flat_params(config).items()]
        for batch in _batches(params, PARAMS_PER_BATCH):
            self._client.log_batch(self._run_id, params=batch)
        self._client.log_dict(self._run_id, config, "config.json")

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        now_ms = int(time.time() * 1000)
        named = {mlflow_name(name): value for name, value in metrics.items()}
        entries = [Metric(name, value, now_ms, step) for name, value in named.items()]
        for batch in _batches(entries, METRICS_PER_BATCH):
            self._client.log_batch(self._run_id, metrics=batch)

    def log_episodes(self, step: int, rows: list[dict[str, Cell]]) -> None:
        names = columns(rows)
        table = {"columns": names, "data": [[row.get(name) for name in names] for row in rows]}
        self._client.log_dict(self._run_id, table, f"episodes/step_{step:08d}.json")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts as dotted names (`algorithm.advantage`), each other value as text: a string as it is, anything
    else as JSON (lists, numbers, booleans, null, an empty dict), cut to MLflow's limit."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            params.update(flat_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        params[mlflow_name(name)] = text[:MAX_PARAM_CHARS]
    return params


def mlflow_name(name: str) -> str:
    """`name` as MLflow takes a metric or param name: letters, digits and `_-./: ` (anything else becomes `_`), a
    path that normalizes to itself (else its slashes become `_` too), at most 250 characters."""
    safe = re.sub(r"[^/\w.\- :]", "_", name)[:MAX_NAME_CHARS]
    if posixpath.normpath(safe) != safe or safe.startswith((".", "/")):
        safe = "_" + safe.replace("/", "_")[: MAX_NAME_CHARS - 1]
    return safe


def _batches(items: Sequence[T], size: int) -> Iterator[list[T]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])
