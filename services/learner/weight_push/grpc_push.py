from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from services.common.weights import PackedWeights
from services.learner.weight_push.base import PUSHERS, PushResult, WeightPusher


@PUSHERS.register("grpc")
class GrpcWeightPusher(WeightPusher):
    """Streams the tensors in chunks to every server concurrently over the RolloutService API, with the
    run's push token (`OMRL_WEIGHT_TOKEN` unless given)."""

    def __init__(self, timeout_s: float = 120.0, token: str | None = None):
        from services.rollout.push_auth import token_from_env

        self.timeout_s = timeout_s
        self.token = token if token is not None else token_from_env()

    def push(
        self, version, weights: PackedWeights, addresses: Sequence[str], *, rollback: bool = False, run: str = ""
    ) -> list[PushResult]:
        return asyncio.run(self._push_all(version, weights, list(addresses), rollback, run))

    async def _push_all(self, version, weights, addresses, rollback, run):
        return list(await asyncio.gather(*(self._push_one(version, weights, a, rollback, run) for a in addresses)))

    async def _push_one(self, version, weights, address, rollback, run) -> PushResult:
        from services.rollout.client import GrpcRolloutClient

        client = GrpcRolloutClient(address, push_timeout_s=self.timeout_s, weight_token=self.token)
        start = time.perf_counter()
        try:
            reply = await client.update_weights(version, weights, rollback=rollback, run=run)
            return PushResult(address, True, reply.policy_version, reply.checksum, time.perf_counter() - start)
        except Exception as exc:  # one unreachable server must not stop the push to the others
            return PushResult(address, False, seconds=time.perf_counter() - start, error=str(exc))
        finally:
            await client.close()
