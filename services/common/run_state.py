"""Shared state of one training run in Redis: rollout registry, published policy version, group
claims, per-step metrics and the done flag. Keys live under `<prefix>:<run>:`."""
from __future__ import annotations

import json
import time
from typing import Any

import redis

from services.common.config import TrainConfig


class RunState:
    def __init__(self, client: redis.Redis, config: TrainConfig):
        self.client, self.config = client, config
        self.k = config.key

    @classmethod
    def connect(cls, config: TrainConfig, timeout_s: float = 10.0) -> "RunState":
        client = redis.Redis.from_url(config.stream.redis_url, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s)
        return cls(client, config)

    @property
    def trajectories_key(self) -> str:
        return self.k("trajectories")

    def rollout_counters(self) -> dict[str, int]:
        """Run-wide infrastructure counters the rollout producers keep (hash `rollout_counters`)."""
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.k("rollout_counters")).items()}

    def add_lost_groups(self, count: int) -> None:
        """Run-wide count of groups the learner dropped (stale or poison); the producers shift later claims
        by it (see services.rollout.producer), so a dropped group is replaced instead of starving a step.
        The key keeps its first name, `stale_groups`, which the producers read."""
        if count:
            self.client.incrby(self.k("stale_groups"), count)

    def lost_groups(self) -> int:
        return int(self.client.get(self.k("stale_groups")) or 0)

    def add_dead_letter(self, reason: str, groups: int) -> None:
        """Run-wide dead-lettered groups by reason (hash `dead_letters`)."""
        self.client.hincrby(self.k("dead_letters"), reason, groups)

    def dead_letter_counts(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.k("dead_letters")).items()}

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
