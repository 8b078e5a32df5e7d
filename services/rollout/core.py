"""The rollout server's logic, free of gRPC: generation on a backend, stamped with the policy
version, and atomic weight updates."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from services.common import metrics
from services.common.weights import TensorSpec, unpack
from services.rollout.backends.base import Generation, RolloutBackend, SamplingSpec
from services.rollout.rwlock import ReadWriteLock

log = logging.getLogger(__name__)

GENERATED_TOKENS = metrics.counter("rollout", "generated_tokens_total", "Tokens sampled by the engine")
GENERATE_LATENCY = metrics.histogram("rollout", "generate_latency_seconds", "Latency of one generation call",
                                     buckets=metrics.DURATION_BUCKETS)
ACTIVE_REQUESTS = metrics.gauge("rollout", "active_requests", "Generation requests in flight")
POLICY_VERSION = metrics.gauge("rollout", "policy_version", "Policy version being served")
WEIGHT_UPDATE_SECONDS = metrics.histogram("rollout", "weight_update_seconds", "Time to apply a weight set",
                                          buckets=metrics.DURATION_BUCKETS)


@dataclass
class VersionedGeneration:
    generation: Generation
    policy_version: int


@dataclass
class UpdateResult:
    policy_version: int
    checksum: str
    bytes_received: int
    apply_seconds: float


class RolloutCore:
    def __init__(self, backend: RolloutBackend, model: str):
        self.backend, self.model = backend, model
        self.policy_version = 0
        self.weights_checksum = ""
        self.generated_tokens = 0
        self.active_episodes = 0
        self._lock = ReadWriteLock()

    async def generate(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSpec) -> VersionedGeneration:
        async with self._lock.read():
            version = self.policy_version
            ACTIVE_REQUESTS.inc()
            start = time.perf_counter()
            try:
                generation = await self.backend.generate(request_id, list(prompt_ids), sampling)
            finally:
                ACTIVE_REQUESTS.dec()
        GENERATE_LATENCY.observe(time.perf_counter() - start)
        self.generated_tokens += len(generation.token_ids)
        GENERATED_TOKENS.inc(len(generation.token_ids))
        return VersionedGeneration(generation, version)

    async def update_weights(self, version: int, specs: Sequence[TensorSpec], payload: bytes,
                             checksum: str) -> UpdateResult:
        """Checks the whole set before touching the engine, then swaps it in while no request runs."""
        tensors = unpack(specs, payload, checksum)
        start = time.perf_counter()
        async with self._lock.write():
            await self.backend.load_weights(tensors)
            self.policy_version, self.weights_checksum = version, checksum
        seconds = time.perf_counter() - start
        POLICY_VERSION.set(version)
        WEIGHT_UPDATE_SECONDS.observe(seconds)
        log.info("policy v%d loaded (%d tensors, %.1f MB) in %.2fs", version, len(specs), len(payload) / 1e6, seconds)
        return UpdateResult(version, checksum, len(payload), seconds)

    def status(self) -> dict:
        return {"model": self.model, "backend": self.backend.name, "policy_version": self.policy_version,
                "weights_checksum": self.weights_checksum, "active_requests": self._lock.readers,
                "generated_tokens_total": self.generated_tokens, "active_episodes": self.active_episodes}
