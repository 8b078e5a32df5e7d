"""Task datasets as parquet, the seeds' (verl) convention: `data/<env>/{train,validation}.parquet`, one
row per task with its index, seed, first prompt and reward-model info. The rollout draws training
tasks from the train split and runs the validation split at the configured interval.

`env.dataset` names a folder of the user's own files (only `task_index` is required: an AgentGym
`data_idx`, say); otherwise the folder is `<data_dir>/<env>` (`<env>-<hash of options>` when options
are set) and is generated on first use: train tasks 0..train_tasks-1, validation tasks right after.
An env whose server serves a fixed set of tasks (`TextEnv.task_range`, e.g. AgentGym maze's games
0..24) gets splits inside it: when the set is smaller than both splits, the last fifth of it (at most
`validation_tasks`) is the validation split and the rest the train split. A dataset with a task
outside the set is rejected before anything uses it.

    python -m services.envs.datasets --env maze --set env.train_tasks=2000   # writes data/maze/
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from services.common.config import EnvConfig
from services.common.dataset_paths import SPLITS, dataset_dir
from services.envs.base import MissingDependency

log = logging.getLogger(__name__)
FORMAT = 1
"""Bumped when generated files change shape; older generated files are rewritten."""
SCHEMA = pa.schema(
    [
        ("task_index", pa.int64()),
        ("seed", pa.int64()),
        ("data_source", pa.string()),
        ("split", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        ("extra_info", pa.struct([("index", pa.int64()), ("options", pa.string())])),
    ]
)


def _meta(env: EnvConfig, split: str) -> dict[str, Any]:
    rows = env.train_tasks if split == "train" else env.validation_tasks
    tasks = task_range(env)
    return {
        "format": FORMAT,
        "env": env.name,
        "options": env.options,
        "rows": rows,
        **({"tasks": [tasks.start, tasks.stop]} if tasks is not None else {}),
    }


def task_range(env: EnvConfig) -> range | None:
    """The task indices the env can serve with these options (None: any)."""
    from services.envs.registry import ENVS

    try:
        cls = ENVS.get(env.name)
    except Exception:  # noqa: BLE001 - the env's package may live only in the env service's image
        return None
    return cls.task_range(dict(env.options))


def split_range(env: EnvConfig, split: str) -> range:
    tasks = task_range(env)
    train, validation = env.train_tasks, env.validation_tasks
    if tasks is None:
        return range(train) if split == "train" else range(train, train + validation)
    if train + validation <= len(tasks):
        return tasks[:train] if split == "train" else tasks[train : train + validation]
    if len(tasks) < 2:
        return tasks
    held_out = min(validation, max(1, len(tasks) // 5))
    return tasks[: min(train, len(tasks) - held_out)] if split == "train" else tasks[len(tasks) - held_out :]


def generate_rows(env: EnvConfig, split: str) -> list[dict[str, Any]]:
    from services.envs.registry import ENVS

    try:
        cls = ENVS.get(env.name)
        offline = getattr(cls, "offline_prompts", True)  # remote envs (AgentGym) cannot be reset offline
    except Exception as exc:  # noqa: BLE001 - e.g. the env's package lives only in the env service's image
        log.warning("writing %s tasks without prompts: %s", env.name, exc)
        offline = False
    rows = []
    for i, task_index in enumerate(split_range(env, split)):
        prompt, truth = None, {}
        if offline:
            instance = cls()
            try:
                prompt = [{"role": "user", "content": instance.reset(task_index, dict(env.options))}]
                truth = instance.task_info()
            except (ImportError, MissingDependency) as exc:
                log.warning("writing %s tasks without prompts: %s", env.name, exc)
                offline = False
            finally:
                instance.close()
        rows.append(
            {
                "task_index": task_index,
                "seed": task_index,
                "data_source": env.name,
                "split": split,
                "prompt": prompt,
                "ability": "agent",
                "reward_model": {"style": "rule" if truth else "env", "ground_truth": json.dumps(truth)},
                "extra_info": {"index": i, "options": json.dumps(env.options, sort_keys=True)},
            }
        )
    return rows


def write_split(env: EnvConfig, split: str, folder: Path | None = None) -> Path:
    folder = folder or dataset_dir(env)
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(generate_rows(env, split), schema=SCHEMA)
    table = table.replace_schema_metadata({b"omrl": json.dumps(_meta(env, split)).encode()})
    path = folder / f"{split}.parquet"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    return path


def ensure(env: EnvConfig) -> Path:
    """The dataset folder, generating (or regenerating stale) splits unless the user named the folder."""
    folder = dataset_dir(env)
    for split in SPLITS:
        path = folder / f"{split}.parquet"
        if env.dataset:
            if not path.exists():
                raise FileNotFoundError(f"env.dataset={env.dataset!r} has no {split}.parquet")
            continue
        if _stored_meta(path) != _meta(env, split):
            log.info("generating %s", path)
            write_split(env, split, folder)
    _check_range(env, folder)
    return folder


def _check_range(env: EnvConfig, folder: Path) -> None:
    tasks = task_range(env)
    if tasks is None:
        return
    for split in SPLITS:
        path = folder / f"{split}.parquet"
        indices = pq.read_table(path, columns=["task_index"]).column("task_index").to_pylist()
        outside = sorted({i for i in indices if i not in tasks})
        if outside:
            raise ValueError(
                f"{path}: task indices {outside[:5]}{' ...' if len(outside) > 5 else ''} are outside "
                f"the tasks {env.name} serves with these options ({tasks.start}..{tasks.stop - 1})"
            )


def _stored_meta(path: Path) -> dict[str, Any] | None:
    try:
        raw = (pq.read_schema(path).metadata or {}).get(b"omrl")
    except (FileNotFoundError, pa.ArrowInvalid, OSError):
        return None
    return json.loads(raw) if raw else None


class NoTaskLeft(ValueError):
    """Every task of a split is quarantined."""


@dataclass
class TaskSplit:
    """The task indices of one split, in file order."""

    split: str
    task_indices: list[int]

    @classmethod
    def load(cls, env: EnvConfig, split: str) -> TaskSplit:
        path = ensure(env) / f"{split}.parquet"
        indices = pq.read_table(path, columns=["task_index"]).column("task_index").to_pylist()
        if not indices:
            raise ValueError(f"{path} has no rows")
        if any(i is None or i < 0 for i in indices):
            raise ValueError(f"{path}: task_index must be a non-negative integer in every row")
        return cls(split, indices)

    def draw(self, key: str, excluded: Set[int] = frozenset()) -> int:
        """A task drawn with a reproducible key (the same key and exclusions always give the same task); one in
        `excluded` (quarantined) is drawn again, with the same key, among the others."""
        task = self.task_indices[random.Random(key).randrange(len(self.task_indices))]
        if task not in excluded:
            return task
        left = [t for t in self.task_indices if t not in excluded]
        if not left:
            raise NoTaskLeft(f"every {self.split} task is quarantined ({len(excluded)}): none is left to play")
        return left[random.Random(key).randrange(len(left))]


def main() -> None:
    import services.plugins  # noqa: F401  (the whole run config is checked when it is parsed)
    from services.common.config_cli import Parser, parse_service_args

    parser = Parser(
        prog="python -m services.envs.datasets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _, config = parse_service_args(parser, shortcuts=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = ensure(config.env)
    for split in SPLITS:
        print(f"{folder / f'{split}.parquet'}: {pq.read_metadata(folder / f'{split}.parquet').num_rows} rows")


if __name__ == "__main__":
    main()
