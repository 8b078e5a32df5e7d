from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from services.common.weight_buckets import MiB, WeightSet
from services.learner.weight_push.base import PUSHERS, PushResult, WeightPusher
from services.learner.weight_push.fanout import BucketFanout


@PUSHERS.register("grpc")
class GrpcWeightPusher(WeightPusher):
    """Streams the set bucket by bucket to every server concurrently over the RolloutService API (each
    bucket built once, sent to all), with the run's push token (`OMRL_WEIGHT_TOKEN` unless given)."""

    def __init__(self, timeout_s: float = 120.0, token: str | None = None, bucket_mb: int = 256):
        from services.rollout.push_auth import token_from_env

        self.timeout_s, self.bucket_bytes = timeout_s, bucket_mb * MiB
        self.token = token if token is not None else token_from_env()

    def push(
        self, version, weights: WeightSet, addresses: Sequence[str], *, rollback: bool = False, run: str = ""
    ) -> list[PushResult]:
        return asyncio.run(self._push_all(version, weights, list(addresses), rollback, run))

    async def _push_all(self, version, weights, addresses, rollback, run):
        header_checksum = weights.checksum  # "" on a first pass: the commit carries it
        fanout = BucketFanout(weights.buckets(self.bucket_bytes), len(addresses))
        pushes = [
            self._push_one(version, weights, header_checksum, a, c, rollback, run)
            for a, c in zip(addresses, fanout.consumers)
        ]
        *results, produced = await asyncio.gather(*pushes, fanout.run(), return_exceptions=True)
        if isinstance(produced, BaseException):
            raise produced
        return results

    async def _push_one(self, version, weights, header_checksum, address, consumer, rollback, run) -> PushResult:
        from services.rollout.client import GrpcRolloutClient

        client = GrpcRolloutClient(address, push_timeout_s=self.timeout_s, weight_token=self.token)
        start = time.perf_counter()
        try:
            reply = await client.push_buckets(
                version,
                weights.specs,
                consumer.buckets(),
                lambda: weights.checksum,
                header_checksum=header_checksum,
                rollback=rollback,
                run=run,
                bucket_bytes=self.bucket_bytes,
            )
            return PushResult(address, True, reply.policy_version, reply.checksum, time.perf_counter() - start)
        except Exception as exc:  # one unreachable server must not stop the push to the others
            return PushResult(address, False, seconds=time.perf_counter() - start, error=str(exc))
        finally:
            consumer.drop()
            await client.close()
