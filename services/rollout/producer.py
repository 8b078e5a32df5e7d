"""Keeps the learner fed: claims task groups run-wide, runs them through the agent loop once the
served policy is fresh enough, scores them, and appends them to the trajectory stream.

Group c (a run-wide counter in Redis) belongs to learner step s = c // groups_per_step and may start
only while the served policy version v satisfies v >= s - max_staleness: with max_staleness 0 every
trajectory of step s comes from policy s (synchronous on-policy training). With max_staleness > 0 the
learner drops trajectories too old for the step that reads them and counts the groups it lost; every such
group shifts later claims one slot earlier (`_wait_for_turn`), so replacements come without a gap."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Optional

from services.common import metrics
from services.common.config import TrainConfig
from services.common.errors import ServiceError
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.envs.datasets import TaskSplit
from services.rollout.agent_loop import AgentLoop, EpisodeFailed

log = logging.getLogger(__name__)

GROUPS = metrics.preset(metrics.counter("rollout", "groups_total", "Task groups by outcome", ["outcome"]),
                        ("published",), ("retried",), ("dropped",), ("abandoned",))
QUEUE_DEPTH = metrics.gauge("rollout", "queue_depth", "Claimed groups waiting for a fresh enough policy")


class Producer:
    def __init__(self, config: TrainConfig, loop: AgentLoop, reward_client: Any, state: RunState,
                 stream: TrajectoryStream, core: Any, poll_s: float = 0.2, max_attempts: int = 3):
        self.config, self.loop, self.rewards, self.state, self.stream, self.core = (
            config, loop, reward_client, state, stream, core)
        self.poll_s, self.max_attempts = poll_s, max_attempts
        self.published = 0
        self._tasks: Optional[TaskSplit] = None
        self._reported: Counter[str] = Counter()

    def task_of(self, claim: int, attempt: int = 1) -> int:
        """A train-split task; a group replaced after an infrastructure failure gets a fresh one, so one
        task that breaks its environment cannot stall a learner step."""
        if self._tasks is None:
            self._tasks = TaskSplit.load(self.config.env, "train")
        key = f"{self.config.seed}:{claim}" + (f":{attempt}" if attempt > 1 else "")
        return self._tasks.draw(key)

    async def run(self) -> None:
        self._tasks = await asyncio.to_thread(TaskSplit.load, self.config.env, "train")
        workers = self.config.rollout.groups_per_step * (1 + self.config.algorithm.max_staleness)
        jobs = [self._worker() for _ in range(workers)]
        if self.config.env.validation_every:
            from services.rollout.validation import Validator

            jobs.append(Validator(self.config, self.loop, self.state, self.core).run())
        await asyncio.gather(*jobs)
        log.info("producer finished after %d groups", self.published)

    async def _count(self, **increments: int) -> None:
        """Run-wide infrastructure counters (Redis hash `rollout_counters`), with the agent loop's."""
        pending = Counter({k: v for k, v in increments.items() if v})
        for key, value in self.loop.stats.items():
            pending[key] += value - self._reported[key]
            self._reported[key] = value
        pending = +pending
        if not pending:
            return
        try:
            await asyncio.to_thread(self._hincrby, dict(pending))
        except Exception as exc:  # noqa: BLE001 - counters are best effort; Prometheus has them too
            log.warning("could not record rollout counters: %s", exc)

    def _hincrby(self, increments: dict[str, int]) -> None:
        pipe = self.state.client.pipeline()
        for key, value in increments.items():
            pipe.hincrby(self.config.key("rollout_counters"), key, value)
        pipe.execute()

    async def _worker(self) -> None:
        per_step, steps = self.config.rollout.groups_per_step, self.config.learner.steps
        while True:
            claim = await asyncio.to_thread(self.state.claim_group)
            if claim // per_step >= steps and not self.config.algorithm.max_staleness:
                return
            QUEUE_DEPTH.inc()
            try:
                if not await self._wait_for_turn(claim):
                    return
            finally:
                QUEUE_DEPTH.dec()
            await self._produce(claim)

    async def _wait_for_turn(self, claim: int) -> bool:
        """Waits until the claim's step is within max_staleness of the served policy; False once the run is
        done. With max_staleness > 0 the learner drops late groups (run-wide count `stale_groups`), and
        each dropped group moves every later claim one slot earlier, so the buffer ahead of the learner
        stays full; a claim past the last step waits in case drops bring it into range."""
        per_step, k = self.config.rollout.groups_per_step, self.config.algorithm.max_staleness
        while True:
            dropped = await asyncio.to_thread(self._stale_groups) if k else 0
            step = (claim - dropped) // per_step
            if step < self.config.learner.steps and self.core.policy_version >= step - k:
                return True
            if await asyncio.to_thread(self.state.done):
                return False
            await asyncio.sleep(self.poll_s)

    def _stale_groups(self) -> int:
        return int(self.state.client.get(self.config.key("stale_groups")) or 0)

    async def _produce(self, claim: int) -> None:
        """A group lost to infrastructure (an episode out of retries, the reward service down) is
        dropped whole, never scored, and replaced by a fresh group for the same learner step, up to
        `max_attempts` groups; after that the slot is abandoned (the learner's step timeout reports it)."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                group = await self.loop.run_group(self.task_of(claim, attempt), group_id=f"g{claim}",
                                                  seed=self.config.seed * 1_000_003 + claim)
                scores = await self.rewards.score(group)
                break
            except (EpisodeFailed, ServiceError) as exc:
                GROUPS.labels(outcome="dropped").inc()
                last = attempt == self.max_attempts
                GROUPS.labels(outcome="abandoned" if last else "retried").inc()
                await self._count(groups_dropped=1, groups_abandoned=int(last), groups_retried=int(not last))
                log.warning("group %d attempt %d/%d dropped: %s", claim, attempt, self.max_attempts, exc)
                if last:
                    log.error("group slot %d abandoned after %d attempts", claim, attempt)
                    return
                await asyncio.sleep(min(2.0 ** attempt, 30.0))
        for traj, (total, components) in zip(group, scores):
            traj.reward = total
            traj.reward_components.update(components)
        await asyncio.to_thread(self.stream.publish, group, f"g{claim}")
        self.published += 1
        GROUPS.labels(outcome="published").inc()
        await self._count(groups_published=1)
