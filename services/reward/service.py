"""The reward service core: scores batches of finished trajectories with one RewardComposer."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from services.common import metrics
from services.common.errors import DeadlineExceeded, Internal, InvalidArgument
from services.common.protos import trajectory_pb2
from services.common.trajectory import RecordError, check_invariants
from services.reward.composer import ComponentFailed, RewardComposer, Scored

log = logging.getLogger(__name__)
Score = Scored
SCORE_BUCKETS = (-2, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 0.75, 1, 2)


class RewardService:
    def __init__(
        self, composer: RewardComposer, *, timeout_s: float = 20.0, metrics_registry: CollectorRegistry | None = None
    ):
        self.composer, self.timeout_s = composer, timeout_s
        reg = metrics_registry
        self._m_latency = metrics.histogram("reward", "score_seconds", "Latency of scoring one batch", registry=reg)
        self._m_scored = metrics.counter("reward", "trajectories_total", "Trajectories scored", registry=reg)
        self._m_component = metrics.histogram(
            "reward",
            "component_score",
            "Weighted score per component",
            ["component"],
            registry=reg,
            buckets=SCORE_BUCKETS,
        )
        self._m_failures = metrics.counter(
            "reward", "component_failures_total", "Score calls a component failed", ["component"], registry=reg
        )
        self._m_total = metrics.histogram(
            "reward", "total_score", "Total score per trajectory", registry=reg, buckets=SCORE_BUCKETS
        )

    async def score(self, trajectories: Sequence[trajectory_pb2.Trajectory]) -> list[Score]:
        """One Scored (total, {component: weighted value}, per-turn process rewards) per trajectory, in order."""
        for traj in trajectories:
            if not isinstance(traj, trajectory_pb2.Trajectory):
                raise InvalidArgument(f"expected Trajectory messages, got {type(traj).__name__}")
            try:
                check_invariants(traj)
            except RecordError as exc:
                raise InvalidArgument(str(exc)) from None
        if not trajectories:
            return []
        start = time.perf_counter()
        # reward functions are plain sync code (some may be slow): keep them off the event loop
        task = asyncio.ensure_future(asyncio.to_thread(self._score_all, list(trajectories)))
        done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
        if not done:
            task.cancel()  # the worker thread finishes on its own; its result is dropped
            raise DeadlineExceeded(f"scoring {len(trajectories)} trajectories took over {self.timeout_s:g}s")
        try:
            scores = task.result()
        except Exception as exc:  # noqa: BLE001 - a reward bug fails this batch only
            if isinstance(exc, ComponentFailed):
                self._m_failures.labels(exc.component).inc()
            log.exception("scoring failed")
            raise Internal(str(exc)) from exc
        self._m_latency.observe(time.perf_counter() - start)
        self._m_scored.inc(len(scores))
        for total, parts, _ in scores:
            self._m_total.observe(total)
            for name, value in parts.items():
                self._m_component.labels(name).observe(value)
        return scores

    def _score_all(self, trajectories: list[trajectory_pb2.Trajectory]) -> list[Score]:
        return self.composer.score_many(trajectories)
