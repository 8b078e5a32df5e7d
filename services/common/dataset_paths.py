"""Where a run's task dataset lives: `env.dataset`, else `<data_dir>/<env>` (`<env>-<hash of options>` when options
are set), with one parquet file per split. Here, below both services, because the env side writes it
(services.envs.datasets) and the reward side reads its reference answers (services.reward.references)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from services.common.config import EnvConfig

SPLITS = ("train", "validation")


def dataset_dir(env: EnvConfig) -> Path:
    if env.dataset:
        return Path(env.dataset)
    name = env.name
    if env.options:
        name += "-" + hashlib.sha256(json.dumps(env.options, sort_keys=True).encode()).hexdigest()[:8]
    return Path(env.data_dir) / name
