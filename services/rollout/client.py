"""Callers of a rollout server: the gRPC client used in production and an in-process one for tests."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from services.common.errors import rpc_errors
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.engines.base import Generation, SamplingSpec
from services.rollout.core import PushHeader, RolloutCore, UpdateResult, VersionedGeneration
from services.weightsync.buckets import Bucket, MiB, WeightSet
from services.weightsync.grpc import send as grpc_send
from services.weightsync.wire import TensorSpec

DEFAULT_BUCKET_BYTES = 256 * MiB


class RolloutClient(abc.ABC):
    @abc.abstractmethod
    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSpec
    ) -> VersionedGeneration: ...

    @abc.abstractmethod
    async def update_weights(
        self,
        version: int,
        weights: WeightSet,
        *,
        rollback: bool = False,
        run: str = "",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> UpdateResult:
        """Streams `weights` bucket by bucket; the set checksum goes in the header when `weights`
        already knows it, in the commit always."""

    @abc.abstractmethod
    async def status(self) -> dict: ...

    async def close(self) -> None:
        pass


class InProcessRolloutClient(RolloutClient):
    def __init__(self, core: RolloutCore):
        self.core = core

    async def generate(self, request_id, prompt_ids, sampling):
        return await self.core.generate(request_id, prompt_ids, sampling)

    async def update_weights(self, version, weights, *, rollback=False, run="", bucket_bytes=DEFAULT_BUCKET_BYTES):
        header = PushHeader(version, weights.specs, weights.checksum, rollback, run, bucket_bytes)
        receiver = self.core.begin_push(header)
        if receiver is None:
            return UpdateResult(self.core.policy_version, self.core.weights_checksum, 0, 0.0)
        try:
            for bucket in weights.buckets(bucket_bytes):
                await self.core.receive(
                    header, receiver, receiver.start_bucket, bucket.specs, bucket.nbytes, bucket.check
                )
                await self.core.receive(header, receiver, receiver.add_data, bucket.data)
            return await self.core.commit_push(header, receiver, weights.checksum)
        finally:
            receiver.abort()

    async def status(self):
        return self.core.status()


class GrpcRolloutClient(RolloutClient):
    """`weight_token`: the shared secret UpdateWeights requires (services.weightsync.credential)."""

    def __init__(
        self, address: str, timeout_s: float = 120.0, push_timeout_s: float = 300.0, weight_token: str | None = None
    ):
        self.address, self.timeout_s, self.push_timeout_s = address, timeout_s, push_timeout_s
        self.weight_token = weight_token
        self._channel: grpc.aio.Channel | None = None
        self._stub: rollout_pb2_grpc.RolloutServiceStub | None = None

    @property
    def stub(self) -> rollout_pb2_grpc.RolloutServiceStub:
        if self._stub is None:  # created on first use so it binds to the running event loop
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)
        return self._stub

    async def generate(self, request_id, prompt_ids, sampling):
        request = rollout_pb2.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_ids),
            sampling=rollout_pb2.SamplingParams(
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                stop_token_ids=sampling.stop_token_ids,
                seed=sampling.seed,
            ),
        )
        with rpc_errors():
            reply = await self.stub.Generate(request, timeout=self.timeout_s)
        return VersionedGeneration(
            Generation(list(reply.token_ids), list(reply.logprobs), reply.finish_reason), reply.policy_version
        )

    async def update_weights(self, version, weights, *, rollback=False, run="", bucket_bytes=DEFAULT_BUCKET_BYTES):
        async def buckets():
            for bucket in weights.buckets(bucket_bytes):
                yield bucket

        return await self.push_buckets(
            version,
            weights.specs,
            buckets(),
            lambda: weights.checksum,
            header_checksum=weights.checksum,
            rollback=rollback,
            run=run,
            bucket_bytes=bucket_bytes,
        )

    async def push_buckets(
        self,
        version: int,
        specs: Sequence[TensorSpec],
        buckets: AsyncIterator[Bucket],
        checksum: Callable[[], str],
        *,
        header_checksum: str = "",
        rollback: bool = False,
        run: str = "",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> UpdateResult:
        """One push whose buckets come from `buckets`; `checksum()` is read once they are exhausted
        (`weightsync.grpc.send.push_buckets`, which the learner's `grpc` pusher calls on channels of its own)."""
        _ = self.stub  # opens the channel
        reply = await grpc_send.push_buckets(
            self._channel,
            version,
            specs,
            buckets,
            checksum,
            header_checksum=header_checksum,
            rollback=rollback,
            run=run,
            bucket_bytes=bucket_bytes,
            timeout_s=self.push_timeout_s,
            token=self.weight_token,
        )
        return UpdateResult(reply.policy_version, reply.checksum, reply.bytes_received, reply.apply_seconds)

    async def status(self):
        with rpc_errors():
            reply = await self.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=self.timeout_s)
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    async def close(self):
        if self._channel is not None:
            await self._channel.close()
