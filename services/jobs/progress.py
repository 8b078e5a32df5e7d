"""A running job's progress as its learner publishes it: per-step metrics (the run's metrics stream) and
the policy version, read from the job's Redis keys."""

from __future__ import annotations

import math
from typing import Any

import redis

from services.common.config import TrainConfig
from services.common.run_state import RunState, redis_client


class ProgressReader:
    def __init__(self, timeout_s: float = 2.0):
        self.timeout_s = timeout_s
        self._clients: dict[str, redis.Redis] = {}

    def read(self, config: TrainConfig, cursor: str) -> tuple[list[dict[str, Any]], str, int | None]:
        """New step metrics after `cursor`, the new cursor, and the published policy version."""
        state = RunState(self._client(config.stream.redis_url), config)
        entries = state.read_metrics(cursor)
        version = state.client.get(state.k("policy_version"))
        return (
            [scalars(m) for _, m in entries],
            (entries[-1][0] if entries else cursor),
            (int(version) if version is not None else None),
        )

    def _client(self, url: str) -> redis.Redis:
        if url not in self._clients:
            self._clients[url] = redis_client(url, self.timeout_s, retries=0)  # Redis away: read next tick
        return self._clients[url]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    """The step's numbers and strings; lists (per-push details) stay in the run's own files."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
        elif isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
    return out
