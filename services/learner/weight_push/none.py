from __future__ import annotations

from collections.abc import Sequence

from services.common.weight_buckets import WeightSet
from services.learner.weight_push.base import PUSHERS, PushResult, WeightPusher


@PUSHERS.register("none")
class NoPush(WeightPusher):
    """Offline training on recorded batches: no rollout server to wait for or to update."""

    needs_servers = False

    def __init__(self, timeout_s: float = 0.0, bucket_mb: int = 0):
        pass

    def push(
        self, version: int, weights: WeightSet, addresses: Sequence[str], *, rollback: bool = False, run: str = ""
    ) -> list[PushResult]:
        return []
