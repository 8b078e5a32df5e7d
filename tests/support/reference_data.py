"""Task datasets with given ground truths, in the layout services.envs.datasets writes (verl's)."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from services.envs.datasets import SCHEMA


def write_references(folder: Path, train: dict, validation: dict | None = None) -> Path:
    """One row per task: {task index: ground truth}, a ground truth that is not a string stored as its JSON."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, truths in (("train", train), ("validation", validation or {})):
        rows = []
        for task, truth in truths.items():
            stored = truth if isinstance(truth, str) else json.dumps(truth)
            rows.append({"task_index": task, "split": split, "reward_model": {"style": "rule", "ground_truth": stored}})
        pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), folder / f"{split}.parquet")
    return folder
