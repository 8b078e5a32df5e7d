"""The `none` weight push: offline training on recorded batches, nothing sent."""

from __future__ import annotations

from collections.abc import Sequence

from services.weightsync.base import PUSHERS, PushResult, WeightPusher
from services.weightsync.buckets import WeightSet


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
