"""Shared state of one training run in Redis: rollout registry, published policy version, group
claims and their leases, per-step metrics and the done flag. Keys live under `<prefix>:<run>:`.

`RunState` and `GroupLeases` use a blocking client (learner, launcher, job API); `AsyncRunState` and
`AsyncGroupLeases` are the same keys and scripts over `redis.asyncio`, for the rollout server's event loop."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from services.common.config import TrainConfig

RECONNECT_TRIES = 12
"""Retries of a Redis command after a connection error, with back-off capped at 5 s: about 45 s in all,
enough for Redis to restart (a pod rescheduled) without failing the caller."""


def redis_client(url: str, timeout_s: float = 10.0, retries: int = RECONNECT_TRIES) -> redis.Redis:
    """A client that reconnects with back-off when Redis goes away (every service uses this one; `retries=0`
    fails at once). A URL without a password takes it from $REDIS_PASSWORD, so that it never has to be on a
    command line."""
    return redis.Redis.from_url(
        url, **_client_options(url, timeout_s), retry=Retry(ExponentialWithJitterBackoff(cap=5.0, base=0.2), retries)
    )


def async_redis_client(url: str, timeout_s: float = 10.0, retries: int = RECONNECT_TRIES) -> redis.asyncio.Redis:
    """`redis_client` for asyncio code: the same reconnection, back-off and password."""
    return redis.asyncio.Redis.from_url(
        url,
        **_client_options(url, timeout_s),
        retry=AsyncRetry(ExponentialWithJitterBackoff(cap=5.0, base=0.2), retries),
    )


def _client_options(url: str, timeout_s: float) -> dict[str, Any]:
    password = None if urlsplit(url).password else os.environ.get("REDIS_PASSWORD") or None
    return {
        "password": password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
    }


class RunState:
    def __init__(self, client: redis.Redis, config: TrainConfig):
        self.client, self.config = client, config
        self.k = config.key
        self._leases: GroupLeases | None = None

    @classmethod
    def connect(cls, config: TrainConfig, timeout_s: float = 10.0) -> RunState:
        return cls(redis_client(config.stream.redis_url, timeout_s), config)

    @property
    def trajectories_key(self) -> str:
        return self.k("trajectories")

    def rollout_counters(self) -> dict[str, int]:
        """Run-wide infrastructure counters the rollout producers keep (hash `rollout_counters`)."""
        return {k.decode(): int(v) for k, v in self.client.hgetall(self.k("rollout_counters")).items()}

    def add_rollout_counters(self, increments: dict[str, int]) -> None:
        pipe = self.client.pipeline()
        for key, value in increments.items():
            pipe.hincrby(self.k("rollout_counters"), key, value)
        pipe.execute()

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

    @property
    def leases(self) -> GroupLeases:
        """Group claims as leases that expire and are taken over (see GroupLeases)."""
        if self._leases is None:
            self._leases = GroupLeases(self.client, self.k)
        return self._leases

    def lost_groups(self) -> int:
        """Claimed groups that will never reach the learner: dropped by the learner (`stale_groups`: stale,
        poison or filtered by dynamic sampling; see GroupLeases.count_lost) or out of attempts (`dead_groups`);
        each one shifts later claims one slot earlier."""
        stale, dead = self.client.mget(self.k("stale_groups"), self.k("dead_groups"))
        return int(stale or 0) + int(dead or 0)

    def raise_claims_to(self, floor: int) -> None:
        """Makes the next claim at least `floor` (after Redis lost the counter), never lowering it."""
        self.client.eval(
            "local c = tonumber(redis.call('GET', KEYS[1]) or '0') "
            "if c < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end",
            1,
            self.k("group_claims"),
            floor,
        )

    def publish_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.client.xadd(self.k("metrics"), {"step": step, "metrics": json.dumps(metrics)}, maxlen=100000)

    def read_metrics(self, after_id: str = "0", block_ms: int | None = None) -> list[tuple[str, dict[str, Any]]]:
        reply = self.client.xread({self.k("metrics"): after_id}, block=block_ms)
        out = []
        for _, items in reply or []:
            for entry_id, fields in items:
                out.append((entry_id.decode(), json.loads(fields[b"metrics"])))
        return out

    def validation_episodes(self, after_id: str = "0", count: int = 16) -> list[tuple[str, int, bytes]]:
        """(entry id, policy version, an encoded TrajectoryBatch) of the validation episodes published after
        `after_id`, oldest first."""
        start = f"({after_id}" if after_id != "0" else "-"  # exclusive of the last entry read
        items = self.client.xrange(self.k("validation_episodes"), start, "+", count)
        return [(i.decode(), int(f.get(b"version", b"0")), f.get(b"batch", b"")) for i, f in items]

    def mark_done(self, reason: str = "finished") -> None:
        self.client.set(self.k("done"), reason)

    def done(self) -> str | None:
        value = self.client.get(self.k("done"))
        return value.decode() if value else None

    def mark_failed(self, reason: str, config_digest: str) -> None:
        """The learner stopped for a reason a restart on the same config does not change (`RunFailed`): a
        launcher does not restart it, and a learner started on this config exits at once."""
        self.client.set(self.k("failed"), json.dumps({"reason": reason, "config": config_digest}))

    def failure(self) -> dict[str, str] | None:
        value = self.client.get(self.k("failed"))
        return json.loads(value) if value else None

    def clear_failure(self) -> None:
        self.client.delete(self.k("failed"))

    def last_group_failure(self) -> dict[str, Any] | None:
        """Why a rollout last dropped a group ({"message", "time"}), or None: what a learner left waiting says."""
        value = self.client.get(self.k("last_group_failure"))
        return json.loads(value) if value else None

    def quarantined_tasks(self) -> dict[int, dict[str, Any]]:
        """Tasks no rollout hands out again in this run (hash `quarantined_tasks`: task -> why, where, when)."""
        return {int(k): json.loads(v) for k, v in self.client.hgetall(self.k("quarantined_tasks")).items()}


class AsyncRunState:
    """The part of RunState a rollout server uses, over `redis.asyncio` (same keys; see RunState)."""

    def __init__(self, client: redis.asyncio.Redis, config: TrainConfig):
        self.client, self.config = client, config
        self.k = config.key
        self.leases = AsyncGroupLeases(client, self.k)

    @classmethod
    def connect(cls, config: TrainConfig, timeout_s: float = 10.0) -> AsyncRunState:
        return cls(async_redis_client(config.stream.redis_url, timeout_s), config)

    async def aclose(self) -> None:
        await self.client.aclose()

    @property
    def trajectories_key(self) -> str:
        return self.k("trajectories")

    async def add_rollout_counters(self, increments: dict[str, int]) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for key, value in increments.items():
                pipe.hincrby(self.k("rollout_counters"), key, value)
            await pipe.execute()

    async def register_rollout(self, address: str, info: dict[str, Any]) -> None:
        await self.client.hset(self.k("rollout_servers"), address, json.dumps({**info, "ts": time.time()}))

    async def unregister_rollout(self, address: str) -> None:
        await self.client.hdel(self.k("rollout_servers"), address)

    async def policy_version(self) -> int:
        return int(await self.client.get(self.k("policy_version")) or 0)

    async def claim_validation(self, version: int) -> bool:
        """True for the one rollout server that validates policy `version`."""
        return bool(await self.client.set(self.k(f"validation_claim:{version}"), "1", nx=True, ex=24 * 3600))

    async def publish_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        await self.client.xadd(self.k("metrics"), {"step": step, "metrics": json.dumps(metrics)}, maxlen=100000)

    async def publish_validation_episodes(self, version: int, batch: bytes) -> None:
        """A validation's episodes (an encoded TrajectoryBatch) for the learner to record: the newest 64 kept."""
        await self.client.xadd(self.k("validation_episodes"), {"version": version, "batch": batch}, maxlen=64)

    async def done(self) -> str | None:
        value = await self.client.get(self.k("done"))
        return value.decode() if value else None

    async def note_group_failure(self, message: str) -> None:
        await self.client.set(
            self.k("last_group_failure"), json.dumps({"message": message, "time": time.time()}), ex=24 * 3600
        )

    async def quarantine_task(self, task: int, record: dict[str, Any]) -> bool:
        """Marks a task that cannot be played for the rest of the run; False when it was marked already."""
        return bool(await self.client.hsetnx(self.k("quarantined_tasks"), str(task), json.dumps(record)))

    async def quarantined_tasks(self) -> set[int]:
        return {int(k) for k in await self.client.hkeys(self.k("quarantined_tasks"))}


@dataclass(frozen=True)
class Lease:
    """A claimed group slot, `holder`'s while it renews it (see GroupLeases).
    `attempt` counts the times the slot was started (claim or take-over); `task` picks its task
    (`Producer.task_of(slot, task)`): kept when a dead holder's lease is taken over, so a lost group is
    replayed on the same task, and bumped when a failed attempt is released."""

    slot: int
    holder: str
    attempt: int
    task: int
    taken_from: str = ""


class LeaseOutcome(str, Enum):
    TAKEN = "taken"
    DEAD = "dead"  # out of attempts: dropped and counted in `dead_groups`
    NONE = "none"


_NOW = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)\n"

# KEYS: claims, stale_groups, dead_groups, leases, expiry; ARGV: holder, groups_per_step, limit_step, ttl_ms,
# floor_step
_CLAIM = (
    _NOW
    + """
local lost = tonumber(redis.call('GET', KEYS[2]) or '0') + tonumber(redis.call('GET', KEYS[3]) or '0')
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
local floor = tonumber(ARGV[5]) * tonumber(ARGV[2]) + lost
if c < floor then c = floor redis.call('SET', KEYS[1], c) end
if math.floor((c - lost) / tonumber(ARGV[2])) >= tonumber(ARGV[3]) then return false end
redis.call('INCR', KEYS[1])
redis.call('HSET', KEYS[4], c, cjson.encode({holder = ARGV[1], attempt = 1, task = 1}))
redis.call('ZADD', KEYS[5], now + tonumber(ARGV[4]), c)
return c
"""
)

# KEYS: leases, expiry, dead_groups; ARGV: holder, ttl_ms, max_attempts
_TAKE_OVER = (
    _NOW
    + """
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 1)
if #due == 0 then return false end
local slot = due[1]
local raw = redis.call('HGET', KEYS[1], slot)
if not raw then redis.call('ZREM', KEYS[2], slot) return {slot, 'gone'} end
local lease = cjson.decode(raw)
if lease.attempt >= tonumber(ARGV[3]) then
  redis.call('HDEL', KEYS[1], slot) redis.call('ZREM', KEYS[2], slot) redis.call('INCR', KEYS[3])
  return {slot, 'dead', lease.holder, lease.attempt, lease.task}
end
local previous = lease.holder
lease.holder, lease.attempt = ARGV[1], lease.attempt + 1
redis.call('HSET', KEYS[1], slot, cjson.encode(lease))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), slot)
return {slot, 'taken', previous, lease.attempt, lease.task}
"""
)

_HELD = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local lease = cjson.decode(raw)
if lease.holder ~= ARGV[2] then return 0 end
"""

# KEYS: leases, expiry; ARGV: slot, holder, ttl_ms
_RENEW = (
    _NOW
    + _HELD
    + """
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

# KEYS: leases, expiry, dead_groups; ARGV: slot, holder, backoff_ms, max_attempts
_RELEASE = (
    _NOW
    + _HELD
    + """
if lease.attempt >= tonumber(ARGV[4]) then
  redis.call('HDEL', KEYS[1], ARGV[1]) redis.call('ZREM', KEYS[2], ARGV[1]) redis.call('INCR', KEYS[3])
  return 2
end
lease.holder, lease.task = '', lease.task + 1
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(lease))
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

# KEYS: leases, expiry, stream, claimed_entries; ARGV: slot, holder, max_len, then the entry's field/value pairs
_PUBLISH = (
    _HELD
    + """
local id = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[4], id, ARGV[1])
return id
"""
)

# KEYS: claimed_entries, stale_groups; ARGV: entry ids
_COUNT_LOST = """
local lost = 0
for _, id in ipairs(ARGV) do lost = lost + redis.call('HDEL', KEYS[1], id) end
if lost > 0 then redis.call('INCRBY', KEYS[2], lost) end
return lost
"""


class _LeaseScripts:
    """What GroupLeases and AsyncGroupLeases share: the keys, each script's arguments and the decoding of
    its reply."""

    def __init__(self, client: redis.Redis | redis.asyncio.Redis, key):
        self.client, self.k = client, key
        self._claim, self._take = client.register_script(_CLAIM), client.register_script(_TAKE_OVER)
        self._renew, self._release = client.register_script(_RENEW), client.register_script(_RELEASE)
        self._publish, self._count_lost = client.register_script(_PUBLISH), client.register_script(_COUNT_LOST)

    @property
    def _keys(self) -> list[str]:
        return [self.k("group_leases"), self.k("group_lease_expiry")]

    def _claim_call(
        self, holder: str, groups_per_step: int, limit_step: int, ttl_s: float, floor_step: int
    ) -> dict[str, list]:
        return {
            "keys": [self.k("group_claims"), self.k("stale_groups"), self.k("dead_groups"), *self._keys],
            "args": [holder, groups_per_step, limit_step, int(ttl_s * 1000), floor_step],
        }

    @staticmethod
    def _claimed(reply, holder: str) -> Lease | None:
        return None if reply is None else Lease(int(reply), holder, 1, 1)

    def _take_call(self, holder: str, ttl_s: float, max_attempts: int) -> dict[str, list]:
        return {"keys": [*self._keys, self.k("dead_groups")], "args": [holder, int(ttl_s * 1000), max_attempts]}

    @staticmethod
    def _taken(reply, holder: str) -> tuple[LeaseOutcome, Lease | None] | None:
        """None when the due slot had no lease left (cleaned up): look again."""
        if not reply:
            return LeaseOutcome.NONE, None
        if reply[1] == b"gone":
            return None
        slot, outcome, previous, attempt, task = reply
        lease = Lease(
            int(slot),
            holder if outcome == b"taken" else previous.decode(),
            int(attempt),
            int(task),
            taken_from=previous.decode(),
        )
        return LeaseOutcome(outcome.decode()), lease

    def _renew_call(self, lease: Lease, ttl_s: float) -> dict[str, list]:
        return {"keys": self._keys, "args": [lease.slot, lease.holder, int(ttl_s * 1000)]}

    def _release_call(self, lease: Lease, backoff_s: float, max_attempts: int) -> dict[str, list]:
        return {
            "keys": [*self._keys, self.k("dead_groups")],
            "args": [lease.slot, lease.holder, int(backoff_s * 1000), max_attempts],
        }

    @staticmethod
    def _released(reply) -> LeaseOutcome | None:
        return {1: LeaseOutcome.TAKEN, 2: LeaseOutcome.DEAD}.get(int(reply))

    def _publish_call(self, lease: Lease, stream_key: str, max_len: int, fields: dict[str, Any]) -> dict[str, list]:
        pairs = [item for pair in fields.items() for item in pair]
        return {
            "keys": [*self._keys, stream_key, self.k("claimed_entries")],
            "args": [lease.slot, lease.holder, max_len, *pairs],
        }

    @staticmethod
    def _published(reply) -> str | None:
        if not reply:
            return None
        return reply.decode() if isinstance(reply, bytes) else str(reply)

    def _queue_remaining(self, pipe) -> None:
        pipe.get(self.k("group_claims"))
        pipe.mget(self.k("stale_groups"), self.k("dead_groups"))
        pipe.zcard(self.k("group_lease_expiry"))

    @staticmethod
    def _remaining(total_groups: int, replies: list) -> int:
        claims, (stale, dead), outstanding = replies
        return max(0, total_groups - int(claims or 0) + int(stale or 0) + int(dead or 0)) + int(outstanding)


class GroupLeases(_LeaseScripts):
    """Claims of group slots as leases (hash `group_leases`: slot -> {holder, attempt, task}; sorted set
    `group_lease_expiry`: slot -> the time, Redis server ms, from which anyone may take the slot).

    Invariants: a slot is in both keys from its claim until it is published or dead-lettered, and in
    neither after; publishing removes the lease in the same script that appends the entry, and only for
    the lease's holder, so a slot is published at most once. A released slot (failed attempt) has no
    holder and becomes due after its back-off; an unrenewed lease becomes due at its expiry.

    The same script records the entry in hash `claimed_entries` (stream entry id -> slot), where it stays
    until the learner acknowledges it trained (`settle`) or counts its group lost (`count_lost`). Only an
    entry found there counts, and finding it removes it: a lost group shifts later claims once, and an
    entry no claim of this run published (written by anyone else, another run's, one already counted)
    never does."""

    def claim(
        self, holder: str, groups_per_step: int, limit_step: int, ttl_s: float, floor_step: int = 0
    ) -> Lease | None:
        """A new slot whose step (counting lost groups, see `lost_groups`) is below `limit_step`, or None.
        Steps below `floor_step` (the served policy version: the learner is past them) are skipped, which
        only happens when Redis lost the claim counter."""
        return self._claimed(
            self._claim(**self._claim_call(holder, groups_per_step, limit_step, ttl_s, floor_step)), holder
        )

    def take_over(self, holder: str, ttl_s: float, max_attempts: int) -> tuple[LeaseOutcome, Lease | None]:
        """The first due slot (holder gone or back-off over): TAKEN with its lease, DEAD with the lease it
        had when it ran out of attempts (now dropped), or NONE when nothing is due."""
        while (taken := self._taken(self._take(**self._take_call(holder, ttl_s, max_attempts)), holder)) is None:
            pass
        return taken

    def renew(self, lease: Lease, ttl_s: float) -> bool:
        """False once the lease is no longer this holder's (taken over, published, dropped)."""
        return bool(self._renew(**self._renew_call(lease, ttl_s)))

    def release(self, lease: Lease, backoff_s: float, max_attempts: int) -> LeaseOutcome | None:
        """After a failed attempt: the slot is due again after `backoff_s`, with a fresh task (TAKEN), or
        dropped once out of attempts (DEAD); None when the lease was no longer held."""
        return self._released(self._release(**self._release_call(lease, backoff_s, max_attempts)))

    def publish(self, lease: Lease, stream_key: str, max_len: int, fields: dict[str, Any]) -> str | None:
        """Appends the group's entry and ends the lease in one step; None (nothing written) when the lease
        is no longer held."""
        return self._published(self._publish(**self._publish_call(lease, stream_key, max_len, fields)))

    def remaining(self, total_groups: int) -> int:
        """Groups of a run of `total_groups` not yet published: slots still to claim (a lost group needs
        one more, see `RunState.lost_groups`) plus slots claimed and neither published nor dropped. Read
        in one transaction, since dropping a slot moves it from the second kind to the first."""
        pipe = self.client.pipeline(transaction=True)
        self._queue_remaining(pipe)
        return self._remaining(total_groups, pipe.execute())

    def count_lost(self, entry_ids: Iterable[str]) -> int:
        """Counts in `stale_groups` the groups of those entries that a claim of this run published and that
        were neither settled nor counted yet (see the class); returns how many. The learner calls it for
        every entry whose group it drops, stale, poison or filtered by dynamic sampling; the others count nothing."""
        ids = sorted(set(entry_ids))
        return int(self._count_lost(keys=[self.k("claimed_entries"), self.k("stale_groups")], args=ids)) if ids else 0

    def settle(self, entry_ids: Iterable[str]) -> None:
        """Forgets entries the learner acknowledged after a checkpoint: their groups were trained (or were
        counted already) and can no longer be lost."""
        ids = list(entry_ids)
        if ids:
            self.client.hdel(self.k("claimed_entries"), *ids)

    def held(self) -> dict[int, dict[str, Any]]:
        return {int(slot): json.loads(raw) for slot, raw in self.client.hgetall(self.k("group_leases")).items()}


class AsyncGroupLeases(_LeaseScripts):
    """GroupLeases over `redis.asyncio`: the same scripts and invariants, each method awaitable."""

    async def claim(
        self, holder: str, groups_per_step: int, limit_step: int, ttl_s: float, floor_step: int = 0
    ) -> Lease | None:
        call = self._claim_call(holder, groups_per_step, limit_step, ttl_s, floor_step)
        return self._claimed(await self._claim(**call), holder)

    async def take_over(self, holder: str, ttl_s: float, max_attempts: int) -> tuple[LeaseOutcome, Lease | None]:
        while (taken := self._taken(await self._take(**self._take_call(holder, ttl_s, max_attempts)), holder)) is None:
            pass
        return taken

    async def renew(self, lease: Lease, ttl_s: float) -> bool:
        return bool(await self._renew(**self._renew_call(lease, ttl_s)))

    async def release(self, lease: Lease, backoff_s: float, max_attempts: int) -> LeaseOutcome | None:
        return self._released(await self._release(**self._release_call(lease, backoff_s, max_attempts)))

    async def publish(self, lease: Lease, stream_key: str, max_len: int, fields: dict[str, Any]) -> str | None:
        return self._published(await self._publish(**self._publish_call(lease, stream_key, max_len, fields)))

    async def remaining(self, total_groups: int) -> int:
        async with self.client.pipeline(transaction=True) as pipe:
            self._queue_remaining(pipe)
            return self._remaining(total_groups, await pipe.execute())
