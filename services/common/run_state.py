"""Shared state of one training run in Redis: rollout registry, published policy version, group
claims, per-step metrics and the done flag. Keys live under `<prefix>:<run>:`."""
from __future__ import annotations

import json
import time
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from services.common.config import TrainConfig

RECONNECT_TRIES = 12
"""Retries of a Redis command after a connection error, with back-off capped at 5 s: about 45 s in all,
enough for Redis to restart (a pod rescheduled) without failing the caller."""


def redis_client(url: str, timeout_s: float = 10.0) -> redis.Redis:
    """A client that reconnects with back-off when Redis goes away (every service uses this one)."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                retry=Retry(ExponentialWithJitterBackoff(cap=5.0, base=0.2), RECONNECT_TRIES),
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


class RunState:
    def __init__(self, client: redis.Redis, config: TrainConfig):
        self.client, self.config = client, config
        self.k = config.key

    @classmethod
    def connect(cls, config: TrainConfig, timeout_s: float = 10.0) -> "RunState":
        return cls(redis_client(config.stream.redis_url, timeout_s), config)

    @property
    def trajectories_key(self) -> str:
        return self.k("trajectories")

    def rollout_counters(self) -> dict[str, int]:
        """Run-wide infrastructure counters the rollout producers keep (hash `rollout_counters`)."""
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.k("rollout_counters")).items()}

    def reset(self) -> int:
        """Deletes every key of the run (a fresh start)."""
        keys = list(self.client.scan_iter(match=self.k("*"), count=1000))
        return self.client.delete(*keys) if keys else 0

    def register_rollout(self, address: str, info: dict[str, Any]) -> None:
        self.client.hset(self.k("rollout_servers"), address, json.dumps({**info, "ts": time.time()}))

    def unregister_rollout(self, address: str) -> None:
        self.client.hdel(self.k("rollout_servers"), address)

    def rollout_servers(self, max_age_s: float = 30.0) -> dict[str, dict[str, Any]]:
        now, live = time.time(), {}
        for addr, raw in self.client.hgetall(self.k("rollout_servers")).items():
            info = json.loads(raw)
            if now - info.get("ts", 0) <= max_age_s:
                live[addr.decode()] = info
        return live

    def publish_version(self, version: int) -> None:
        self.client.set(self.k("policy_version"), version)

    def policy_version(self) -> int:
        return int(self.client.get(self.k("policy_version")) or 0)

    def claim_group(self) -> int:
        """A run-wide, 0-based group number; group c belongs to learner step c // groups_per_step."""
        return int(self.client.incr(self.k("group_claims"))) - 1

    def raise_claims_to(self, floor: int) -> None:
        """Makes the next claim at least `floor` (after Redis lost the counter), never lowering it."""
        self.client.eval("local c = tonumber(redis.call('GET', KEYS[1]) or '0') "
                         "if c < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end",
                         1, self.k("group_claims"), floor)

    def publish_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.client.xadd(self.k("metrics"), {"step": step, "metrics": json.dumps(metrics)}, maxlen=100000)

    def read_metrics(self, after_id: str = "0", block_ms: int | None = None) -> list[tuple[str, dict[str, Any]]]:
        reply = self.client.xread({self.k("metrics"): after_id}, block=block_ms)
        out = []
        for _, items in reply or []:
            for entry_id, fields in items:
                out.append((entry_id.decode(), json.loads(fields[b"metrics"])))
        return out

    def mark_done(self, reason: str = "finished") -> None:
        self.client.set(self.k("done"), reason)

    def done(self) -> str | None:
        value = self.client.get(self.k("done"))
        return value.decode() if value else None
