"""Keeps the learner fed: claims task groups run-wide, runs them through the agent loop once the
served policy is fresh enough, scores them, and appends them to the trajectory stream.

Group slot c (a run-wide counter in Redis) belongs to learner step s = c // groups_per_step and is claimed
only while the served policy version v satisfies v >= s - max_staleness: with max_staleness 0 every
trajectory of step s comes from policy s (synchronous on-policy training). With max_staleness > 0 the
learner drops trajectories too old for the step that reads them and counts the groups it lost; every such
group shifts later claims one slot earlier, so replacements come without a gap.

A claim is a lease (services.common.run_state.GroupLeases) renewed while the group is played. A slot whose
holder died (its lease expired) is taken over by any live worker and replayed on the same task; a failed
attempt (an episode out of retries, the reward service down) releases the slot, which is retried after a
back-off on a fresh task; a slot out of attempts is dropped, counted, and replaced like a stale group.
Publishing ends the lease in the same Redis script, so no group reaches the stream twice."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Set
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from services.common import metrics
from services.common.config import TrainConfig
from services.common.errors import ServiceError
from services.common.run_state import AsyncRunState, Lease, LeaseOutcome
from services.common.stream import entry_fields
from services.envs.base import abandoned_reason
from services.envs.datasets import NoTaskLeft, TaskSplit
from services.rollout.agent_loop import AgentLoop, EpisodeFailed
from services.rollout.loop_stages import StageClock
from services.rollout.supervision import TRANSIENT_REDIS

log = logging.getLogger(__name__)

GROUPS = metrics.preset(
    metrics.counter("rollout", "groups_total", "Task groups by outcome", ["outcome"]),
    ("published",),
    ("dropped",),
    ("released",),
    ("retried",),
    ("taken_over",),
    ("superseded",),
    ("dead_lettered",),
)
QUEUE_DEPTH = metrics.gauge("rollout", "queue_depth", "Workers waiting for a group slot the served policy may start")
MAX_BACKOFF_S = 30.0
MAX_REDIS_BACKOFF_S = 10.0
T = TypeVar("T")


class Producer:
    def __init__(
        self,
        config: TrainConfig,
        loop: AgentLoop,
        reward_client: Any,
        state: AsyncRunState,
        core: Any,
        poll_s: float = 0.5,
        max_attempts: int | None = None,
        holder: str | None = None,
    ):
        """Groups are appended to `state.trajectories_key`, trimmed to about `config.stream.max_len` entries.
        A worker waiting for a fresh enough policy wakes when a weight push lands (`core.wait_for_new_version`,
        where the core has it); `poll_s` bounds how late it sees what only Redis tells (a due retry, a
        take-over, the end of the run)."""
        self.config, self.loop, self.rewards, self.state, self.core = config, loop, reward_client, state, core
        self.score_each_episode = config.reward.score_each == "episode"
        self.poll_s = poll_s
        self.redis_retry_s = 0.2  # first wait after a Redis connection error; doubles, up to 10 s
        self.max_attempts = max_attempts or config.rollout.max_group_attempts
        self.ttl_s = config.rollout.lease_ttl_s
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.published = 0
        self._tasks: TaskSplit | None = None
        self._reported: Counter[str] = Counter()
        self.clock: StageClock = getattr(loop, "clock", None) or StageClock()

    def task_of(self, claim: int, attempt: int = 1, quarantined: Set[int] = frozenset()) -> int:
        """A train-split task; a group replaced after an infrastructure failure gets a fresh one, so one
        task that breaks its environment cannot stall a learner step, and a quarantined task is never drawn."""
        if self._tasks is None:
            self._tasks = TaskSplit.load(self.config.env, "train")
        key = f"{self.config.seed}:{claim}" + (f":{attempt}" if attempt > 1 else "")
        return self._tasks.draw(key, quarantined)

    async def run(self) -> None:
        self._tasks = await asyncio.to_thread(TaskSplit.load, self.config.env, "train")
        workers = self.config.rollout.groups_per_step * (1 + self.config.algorithm.max_staleness)
        jobs = [self._worker(f"{self.holder}/{i}") for i in range(workers)]  # a lease is one worker's
        if self.config.env.validation_every:
            from services.rollout.evaluation import Evaluator

            jobs.append(Evaluator(self.config, self.loop, self.state, self.core).run())
        await asyncio.gather(*jobs)
        log.info("producer finished after %d groups", self.published)

    async def _redis(self, call: Callable[..., Awaitable[T]], *args: Any) -> T:
        """A Redis call whose connection errors and timeouts (Redis restarting, a failover; the client has
        already retried for about 45 s) are retried with back-off, forever, so an outage pauses the workers
        instead of ending them (their leases lapse meanwhile and are taken over); any other error
        propagates to the server's supervision."""

        def warn(state: RetryCallState) -> None:
            log.warning(
                "redis call %s failed (%s), retry %d in %.1fs",
                getattr(call, "__name__", call),
                state.outcome.exception(),
                state.attempt_number,
                state.upcoming_sleep,
            )

        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(TRANSIENT_REDIS),
            before_sleep=warn,
            wait=wait_exponential(multiplier=self.redis_retry_s, max=MAX_REDIS_BACKOFF_S),
        ):
            with attempt:
                return await call(*args)
        raise AssertionError("unreachable: retried until it returns")

    async def _count(self, **increments: int) -> None:
        """Run-wide infrastructure counters (Redis hash `rollout_counters`), with the agent loop's."""
        pending = Counter({k: v for k, v in increments.items() if v})
        for key, value in self.loop.stats.items():
            pending[key] += value - self._reported[key]
            self._reported[key] = value
        pending = +pending
        for key, value in increments.items():
            if value and key.startswith("groups_"):
                GROUPS.labels(outcome=key[len("groups_") :]).inc(value)
        if not pending:
            return
        try:
            await self.state.add_rollout_counters(dict(pending))
        except Exception as exc:  # noqa: BLE001 - counters are best effort; Prometheus has them too
            log.warning("could not record rollout counters: %s", exc)

    async def _worker(self, holder: str) -> None:
        while True:
            with self.clock.time("slot_wait"):
                lease = await self._next_lease(holder)
            if lease is None:
                return
            await self._produce(lease)

    async def _next_lease(self, holder: str) -> Lease | None:
        """The next slot to play: first a due one (its holder gone, or a failed group past its back-off),
        so claimed steps fill before new ones start; else a new slot whose step is at most max_staleness
        ahead of the served policy; None once the run is over."""
        per_step, k = self.config.rollout.groups_per_step, self.config.algorithm.max_staleness
        leases, waiting = self.state.leases, False
        try:
            while True:
                outcome, lease = await self._redis(leases.take_over, holder, self.ttl_s, self.max_attempts)
                if outcome is LeaseOutcome.DEAD:
                    log.error(
                        "group slot %d dropped after %d attempts; a new slot replaces it", lease.slot, lease.attempt
                    )
                    await self._count(groups_dead_lettered=1)
                    continue
                if outcome is LeaseOutcome.TAKEN:
                    if lease.taken_from:
                        log.warning(
                            "group slot %d taken over from %s (attempt %d)", lease.slot, lease.taken_from, lease.attempt
                        )
                    await self._count(
                        groups_taken_over=int(bool(lease.taken_from)), groups_retried=int(not lease.taken_from)
                    )
                    return lease
                seen = self.core.policy_version
                limit = min(self.config.learner.steps, seen + k + 1)
                lease = await self._redis(leases.claim, holder, per_step, limit, self.ttl_s, seen)
                if lease is not None:
                    return lease
                if await self._redis(self._finished):
                    return None
                if not waiting:
                    QUEUE_DEPTH.inc()
                    waiting = True
                await self._wait_for_new_version(seen)
        finally:
            if waiting:
                QUEUE_DEPTH.dec()

    async def _wait_for_new_version(self, seen: int) -> None:
        wait = getattr(self.core, "wait_for_new_version", None)
        if wait is None:  # a stand-in core without push events
            await asyncio.sleep(self.poll_s)
        else:
            await wait(seen, self.poll_s)

    async def _finished(self) -> bool:
        """The learner marked the run done; or, without staleness drops (max_staleness 0) and without dynamic
        sampling, every step's slots are claimed and none is still outstanding."""
        if await self.state.done():
            return True
        # dynamic sampling: the learner may yet filter a last-step group it has not read, which a new slot replaces
        if self.config.algorithm.max_staleness or self.config.algorithm.dynamic_sampling:
            return False
        total = self.config.learner.steps * self.config.rollout.groups_per_step
        return await self.state.leases.remaining(total) == 0

    async def _produce(self, lease: Lease) -> None:
        renewal = asyncio.create_task(self._renew(lease))
        group_id = f"g{lease.slot}"
        try:
            task = None
            try:
                quarantined = await self._redis(self.state.quarantined_tasks)
                task = self.task_of(lease.slot, lease.task, quarantined)
                group, scores = await self._play_and_score(task, group_id, lease.slot)
            except (EpisodeFailed, ServiceError, NoTaskLeft) as exc:
                reason = abandoned_reason(str(exc))
                if task is not None and reason is not None:
                    await self._quarantine(lease, task, reason, exc)
                await self._release(lease, exc)
                return
            for traj, scored in zip(group, scores):
                scored.apply_to(traj)
            with self.clock.time("publish"):
                fields = entry_fields(group, group_id)
                entry_id = await self._redis(
                    self.state.leases.publish, lease, self.state.trajectories_key, self.config.stream.max_len, fields
                )
        finally:
            renewal.cancel()
        if entry_id is None:  # also when a publish whose reply was lost is retried: it ended the lease
            log.warning("group slot %d was taken over while this holder played it; result discarded", lease.slot)
            await self._count(groups_superseded=1)
            return
        self.published += 1
        await self._count(groups_published=1)

    async def _play_and_score(self, task: int, group_id: str, slot: int) -> tuple[list, list]:
        """The group's episodes and their rewards: asked for as each episode ends (`reward.score_each`: a reward
        model's time then overlaps the group's other episodes, and only the last one's is left after play), or in
        one call after the last."""
        seed = self.config.seed * 1_000_003 + slot
        if not self.score_each_episode:
            group = await self.loop.run_group(task, group_id=group_id, seed=seed)
            played = time.perf_counter()
            with self.clock.time("reward"):
                scores = await self.rewards.score(group)
            self.clock.record("reward_wait", time.perf_counter() - played)
            return group, scores
        scored: dict[int, Any] = {}
        played = 0.0

        async def score(i: int, traj: Any) -> None:
            nonlocal played
            played = max(played, time.perf_counter())
            with self.clock.time("reward"):
                (scored[i],) = await self.rewards.score([traj])

        group = await self.loop.run_group(task, group_id=group_id, seed=seed, on_episode=score)
        self.clock.record("reward_wait", time.perf_counter() - played)
        return group, [scored[i] for i in range(len(group))]

    async def _quarantine(self, lease: Lease, task: int, reason: str, exc: Exception) -> None:
        """A task its environment cannot play (a reset that never answered, an index its server rejects) is not
        handed out again in this run, by any rollout: the first to see it marks it in Redis and tells the run's
        metrics stream (`kind: alert`), which the launcher's live view and the job's events show."""
        message = f"task {task} quarantined for the rest of the run ({reason}): {str(exc)[-500:]}"
        record = {"reason": reason, "message": message, "time": time.time(), "holder": self.holder}
        if not await self._redis(self.state.quarantine_task, task, record):
            return
        log.error("%s", message)
        await self._count(tasks_quarantined=1)
        alert = {"kind": "alert", "what": "task_quarantined", "task": task, "reason": reason, "message": message}
        try:
            await self.state.publish_metrics(lease.slot // self.config.rollout.groups_per_step, alert)
        except Exception as exc:  # noqa: BLE001 - the quarantine holds; the alert is best effort
            log.warning("could not publish the quarantine alert: %s", exc)

    async def _release(self, lease: Lease, exc: Exception) -> None:
        """A failed group is dropped whole, never scored; its slot is retried on a fresh task after a
        back-off, by whichever worker is free then, until it runs out of attempts."""
        backoff = min(self.config.rollout.group_retry_backoff_s * 2 ** (lease.task - 1), MAX_BACKOFF_S)
        outcome = await self._redis(self.state.leases.release, lease, backoff, self.max_attempts)
        await self._redis(self.state.note_group_failure, f"group slot {lease.slot}: {str(exc)[-600:]}")
        log.warning("group slot %d attempt %d/%d dropped: %s", lease.slot, lease.attempt, self.max_attempts, exc)
        if outcome is LeaseOutcome.DEAD:
            log.error("group slot %d dropped after %d attempts; a new slot replaces it", lease.slot, lease.attempt)
        await self._count(
            groups_dropped=1,
            groups_released=int(outcome is LeaseOutcome.TAKEN),
            groups_dead_lettered=int(outcome is LeaseOutcome.DEAD),
            groups_superseded=int(outcome is None),
        )

    async def _renew(self, lease: Lease) -> None:
        """Renews the lease every third of its TTL until cancelled or lost. A Redis hiccup skips a renewal;
        the TTL leaves room for two."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                held = await self.state.leases.renew(lease, self.ttl_s)
            except TRANSIENT_REDIS as exc:
                log.warning("lease renewal of group slot %d failed: %s", lease.slot, exc)
                continue
            if not held:
                log.warning("lease of group slot %d lost (taken over)", lease.slot)
                return
