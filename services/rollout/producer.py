"""Keeps the learner fed: claims task groups run-wide, runs them through the agent loop once the
served policy is fresh enough, scores them, and appends them to the trajectory stream.

Group c (a run-wide counter in Redis) belongs to learner step s = c // groups_per_step and may start
only while the served policy version v satisfies v >= s - max_staleness: with max_staleness 0 every
trajectory of step s comes from policy s (synchronous on-policy training)."""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from services.common import metrics
from services.common.config import TrainConfig
from services.common.errors import ServiceError
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.rollout.agent_loop import AgentLoop, EpisodeFailed

log = logging.getLogger(__name__)

GROUPS = metrics.counter("rollout", "groups_total", "Task groups by outcome", ["outcome"])
QUEUE_DEPTH = metrics.gauge("rollout", "queue_depth", "Claimed groups waiting for a fresh enough policy")


class Producer:
    def __init__(self, config: TrainConfig, loop: AgentLoop, reward_client: Any, state: RunState,
                 stream: TrajectoryStream, core: Any, poll_s: float = 0.2, max_attempts: int = 3):
        self.config, self.loop, self.rewards, self.state, self.stream, self.core = (
            config, loop, reward_client, state, stream, core)
        self.poll_s, self.max_attempts = poll_s, max_attempts
        self.published = 0

    def task_of(self, claim: int) -> int:
        return random.Random(f"{self.config.seed}:{claim}").randrange(self.config.env.train_tasks)

    async def run(self) -> None:
        workers = self.config.rollout.groups_per_step * (1 + self.config.algorithm.max_staleness)
        await asyncio.gather(*(self._worker() for _ in range(workers)))
        log.info("producer finished after %d groups", self.published)

    async def _worker(self) -> None:
        per_step = self.config.rollout.groups_per_step
        while True:
            claim = await asyncio.to_thread(self.state.claim_group)
            step = claim // per_step
            if step >= self.config.learner.steps:
                return
            QUEUE_DEPTH.inc()
            try:
                while self.core.policy_version < step - self.config.algorithm.max_staleness:
                    if await asyncio.to_thread(self.state.done):
                        return
                    await asyncio.sleep(self.poll_s)
            finally:
                QUEUE_DEPTH.dec()
            await self._produce(claim)

    async def _produce(self, claim: int) -> None:
        """A failed group is played again from scratch (its partial episodes are discarded): the
        learner step it belongs to needs it, and infrastructure failures must never be scored."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                group = await self.loop.run_group(self.task_of(claim), group_id=f"g{claim}",
                                                  seed=self.config.seed * 1_000_003 + claim)
                scores = await self.rewards.score(group)
                break
            except (EpisodeFailed, ServiceError) as exc:
                GROUPS.labels(outcome="retried" if attempt < self.max_attempts else "dropped").inc()
                log.warning("group %d attempt %d/%d failed: %s", claim, attempt, self.max_attempts, exc)
                await asyncio.sleep(min(2.0 ** attempt, 30.0))
        else:
            return
        for traj, (total, components) in zip(group, scores):
            traj.reward = total
            traj.reward_components.update(components)
        await asyncio.to_thread(self.stream.publish, group, f"g{claim}")
        self.published += 1
        GROUPS.labels(outcome="published").inc()
