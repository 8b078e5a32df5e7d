"""Held-out evaluation, on the validation split: whenever the served policy version reaches a multiple of
`env.validation_every` (0 included, the starting policy), one rollout server (claimed run-wide in
Redis) plays every validation task once, at `env.validation_temperature`, and publishes the success
rate per environment to the run's metrics stream as an entry with `"kind": "validation"`.

Validation episodes share the engine with training episodes and never reach the trajectory stream (a sample goes
to the run's `validation_episodes` stream, which the learner records apart: services/learner/episodes.py); a push
that lands while they play samples their later turns from the newer policy, counted
(`validation/turns_of_later_versions`).
Episodes lost to infrastructure are retried like training ones; those that still fail are left out
of the rates and counted (`validation/failed_episodes`)."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from statistics import mean
from typing import Any

from services.common import metrics
from services.common.config import TrainConfig
from services.common.run_state import AsyncRunState
from services.common.trajectory import encode_batch
from services.envs.datasets import TaskSplit
from services.envs.deadlines import VALIDATION_CONCURRENCY
from services.rollout.agent_loop import AgentLoop

log = logging.getLogger(__name__)
VALIDATION_SUCCESS = metrics.gauge(
    "rollout", "validation_success_rate", "Success rate on the validation split", ["env"]
)


class Evaluator:
    def __init__(
        self,
        config: TrainConfig,
        loop: AgentLoop,
        state: AsyncRunState,
        core: Any,
        poll_s: float = 0.5,
        concurrency: int = VALIDATION_CONCURRENCY,
    ):
        self.config, self.state, self.core, self.poll_s = config, state, core, poll_s
        self.loop = copy.copy(loop)
        self.loop.rollout = loop.rollout.model_copy(update={"temperature": config.env.validation_temperature})
        self.loop.stats = loop.stats  # infrastructure failures count the same wherever they happen
        self._slots = asyncio.Semaphore(concurrency)

    def due(self, version: int) -> bool:
        every = self.config.env.validation_every
        return every > 0 and version % every == 0 and version <= self.config.learner.steps

    async def run(self) -> None:
        done: set[int] = set()
        while True:
            version = self.core.policy_version
            if self.due(version) and version not in done:
                done.add(version)
                if await self.state.claim_validation(version):  # one rollout server validates each version
                    await self.evaluate(version)
            if version >= self.config.learner.steps or await self.state.done():
                return
            wait = getattr(self.core, "wait_for_new_version", None)
            if wait is None:  # a stand-in core without push events
                await asyncio.sleep(self.poll_s)
            else:
                await wait(version, self.poll_s)

    async def evaluate(self, version: int) -> dict[str, Any]:
        start = time.perf_counter()
        split = await asyncio.to_thread(TaskSplit.load, self.config.env, "validation")
        results = await asyncio.gather(
            *(self._episode(version, i, task) for i, task in enumerate(split.task_indices)), return_exceptions=True
        )
        played = [r for r in results if not isinstance(r, BaseException)]
        failed = len(results) - len(played)
        name = self.config.env.name
        summary: dict[str, Any] = {
            "kind": "validation",
            "policy_version": version,
            "envs": [name],
            "validation/episodes": len(played),
            "validation/failed_episodes": failed,
            "validation/turns_of_later_versions": sum(
                turn.policy_version > version for t in played for turn in t.turns
            ),
            "validation_seconds": time.perf_counter() - start,
        }
        if played:
            summary[f"validation/{name}/success_rate"] = mean(float(t.success) for t in played)
            summary[f"validation/{name}/env_return"] = mean(t.env_return for t in played)
            summary[f"validation/{name}/turns"] = mean(len(t.turns) for t in played)
            VALIDATION_SUCCESS.labels(name).set(summary[f"validation/{name}/success_rate"])
        await self.state.publish_metrics(version, summary)
        await self._publish_episodes(version, played)
        log.info("validation at policy v%d: %s", version, {k: v for k, v in summary.items() if "/" in k})
        return summary

    async def _publish_episodes(self, version: int, played: list) -> None:
        """The first `logging.episodes_per_step` episodes (-1: all) for the learner to record. An entry over the
        stream's entry size goes without them (said here): the learner, which waits for the final policy's
        entry, still hears that this validation ended."""
        limit = self.config.logging.episodes_per_step
        payload = encode_batch(played if limit < 0 else played[:limit], f"val-v{version}")
        if len(payload) > self.config.stream.max_entry_bytes:
            log.warning(
                "validation episodes of v%d not recorded: %d bytes, over stream.max_entry_bytes", version, len(payload)
            )
            payload = encode_batch([], f"val-v{version}")
        await self.state.publish_validation_episodes(version, payload)

    async def _episode(self, version: int, i: int, task_index: int):
        async with self._slots:
            return await self.loop.run_episode_with_retries(
                task_index, f"val-v{version}", seed=self.config.seed * 7_919 + i
            )
