"""Callers of a rollout server: the gRPC client used in production and an in-process one for tests."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from services.common.errors import rpc_errors
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.common.weight_buckets import Bucket, MiB, WeightSet
from services.common.weights import TensorSpec
from services.rollout.backends.base import Generation, SamplingSpec
from services.rollout.core import PushHeader, RolloutCore, UpdateResult, VersionedGeneration
from services.rollout.push_auth import auth_metadata

DEFAULT_BUCKET_BYTES = 256 * MiB
PUSH_CHUNK_BYTES = 4 * MiB
"""Data message size of a bucketed push: a rollout server takes messages up to 64 MiB
(`grpc_server.serve`); 4 MiB keeps the per-message steps few (a quarter of 1 MiB chunks')."""


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


def encoded_data_chunk(data) -> bytes:
    """`WeightChunk(data=data).SerializeToString()` built straight from `data` (a memoryview of a bucket):
    one copy of the bytes instead of two (into a `bytes`, then into the serialized message)."""
    size, length = len(data), bytearray()
    while True:  # the length as a protobuf varint
        low, size = size & 0x7F, size >> 7
        length.append(low | (0x80 if size else 0))
        if not size:
            break
    return b"".join((_DATA_TAG, length, data))


_DATA_TAG = bytes([2 << 3 | 2])  # WeightChunk field 2 (`data`), wire type 2 (length-delimited)


def _serialize(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class GrpcRolloutClient(RolloutClient):
    """`weight_token`: the shared secret UpdateWeights requires (services.rollout.push_auth)."""

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
        """One push whose buckets come from `buckets` (shared with other servers' pushes by a fan-out);
        `checksum()` is read once they are exhausted."""
        header = rollout_pb2.WeightUpdateHeader(
            version=version,
            checksum=header_checksum,
            rollback=rollback,
            run=run,
            total_bytes=sum(s.nbytes for s in specs),
            bucket_bytes=bucket_bytes,
            tensors=_specs_to_proto(specs),
        )

        async def messages():
            yield rollout_pb2.WeightChunk(header=header)
            async for bucket in buckets:
                yield rollout_pb2.WeightChunk(
                    bucket=rollout_pb2.WeightBucket(
                        tensors=_specs_to_proto(bucket.specs),
                        nbytes=bucket.nbytes,
                        sha256=bucket.sha256,
                        digest=bucket.digest,
                    )
                )
                for start in range(0, bucket.nbytes, PUSH_CHUNK_BYTES):
                    yield encoded_data_chunk(bucket.data[start : start + PUSH_CHUNK_BYTES])
            yield rollout_pb2.WeightChunk(commit=rollout_pb2.WeightCommit(checksum=checksum()))

        _ = self.stub  # opens the channel
        update = self._channel.stream_unary(  # UpdateWeights, taking data chunks already encoded
            "/openmanus.rollout.v1.RolloutService/UpdateWeights",
            request_serializer=_serialize,
            response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString,
        )
        with rpc_errors():
            reply = await update(messages(), timeout=self.push_timeout_s, metadata=auth_metadata(self.weight_token))
        return UpdateResult(reply.policy_version, reply.checksum, reply.bytes_received, reply.apply_seconds)

    async def push_dist(
        self,
        version: int,
        specs: Sequence[TensorSpec],
        declarations: AsyncIterator,
        *,
        rendezvous,
        rollback: bool = False,
        run: str = "",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        digests_follow: bool = False,
    ) -> UpdateResult:
        """An `nccl` push's control stream: the header naming the process group (`weight_dist.Rendezvous`),
        then what `declarations` yields (`("bucket", specs, nbytes, digest)` as each bucket is broadcast,
        with `digests_follow` its digest "" and `("digest", digest)` after it, then `("commit", checksum)`);
        the bytes travel in the group."""
        header = rollout_pb2.WeightUpdateHeader(
            version=version,
            rollback=rollback,
            run=run,
            total_bytes=sum(s.nbytes for s in specs),
            bucket_bytes=bucket_bytes,
            tensors=_specs_to_proto(specs),
            dist=rollout_pb2.WeightDistRendezvous(
                host=rendezvous.host,
                port=rendezvous.port,
                group=rendezvous.group,
                backend=rendezvous.backend,
                timeout_s=rendezvous.timeout_s,
                digests_follow=digests_follow,
            ),
        )

        async def messages():
            yield rollout_pb2.WeightChunk(header=header)
            async for item in declarations:
                if item[0] == "bucket":
                    _, bucket_specs, nbytes, digest = item
                    yield rollout_pb2.WeightChunk(
                        bucket=rollout_pb2.WeightBucket(
                            tensors=_specs_to_proto(bucket_specs), nbytes=nbytes, digest=digest
                        )
                    )
                elif item[0] == "digest":
                    yield rollout_pb2.WeightChunk(bucket_digest=item[1])
                else:
                    yield rollout_pb2.WeightChunk(commit=rollout_pb2.WeightCommit(checksum=item[1]))

        with rpc_errors():
            reply = await self.stub.UpdateWeights(
                messages(), timeout=self.push_timeout_s, metadata=auth_metadata(self.weight_token)
            )
        return UpdateResult(reply.policy_version, reply.checksum, reply.bytes_received, reply.apply_seconds)

    async def status(self):
        with rpc_errors():
            reply = await self.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=self.timeout_s)
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    async def close(self):
        if self._channel is not None:
            await self._channel.close()


def _specs_to_proto(specs: Sequence[TensorSpec]) -> list:
    return [rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes) for s in specs]
