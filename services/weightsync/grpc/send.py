"""The sending end of a `grpc` weight push, on the learner (the receiving end is `grpc.receive`): the set's
bytes stream bucket by bucket in the UpdateWeights call itself, to every server concurrently, each bucket
built once (`fanout`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from services.common.protos import rollout_pb2
from services.weightsync.base import PUSHERS, PushResult, WeightPusher
from services.weightsync.buckets import Bucket, MiB, WeightSet
from services.weightsync.credential import token_from_env
from services.weightsync.grpc.fanout import BucketFanout
from services.weightsync.rpc import specs_to_proto, update_header, update_weights
from services.weightsync.wire import TensorSpec

PUSH_CHUNK_BYTES = 4 * MiB
"""Data message size of a bucketed push: a rollout server takes messages up to 64 MiB
(`grpc_server.serve`); 4 MiB keeps the per-message steps few (a quarter of 1 MiB chunks')."""


@PUSHERS.register("grpc")
class GrpcWeightPusher(WeightPusher):
    """Streams the set bucket by bucket to every server concurrently over the RolloutService API (each
    bucket built once, sent to all), with the run's push token (`OMRL_WEIGHT_TOKEN` unless given)."""

    def __init__(self, timeout_s: float = 120.0, token: str | None = None, bucket_mb: int = 256):
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
        channel = None
        start = time.perf_counter()
        try:
            channel = grpc.aio.insecure_channel(address)
            reply = await push_buckets(
                channel,
                version,
                weights.specs,
                consumer.buckets(),
                lambda: weights.checksum,
                header_checksum=header_checksum,
                rollback=rollback,
                run=run,
                bucket_bytes=self.bucket_bytes,
                timeout_s=self.timeout_s,
                token=self.token,
            )
            return PushResult(address, True, reply.policy_version, reply.checksum, time.perf_counter() - start)
        except Exception as exc:  # one unreachable server must not stop the push to the others
            return PushResult(address, False, seconds=time.perf_counter() - start, error=str(exc))
        finally:
            consumer.drop()
            if channel is not None:
                await channel.close()


async def push_buckets(
    channel: grpc.aio.Channel,
    version: int,
    specs: Sequence[TensorSpec],
    buckets: AsyncIterator[Bucket],
    checksum: Callable[[], str],
    *,
    header_checksum: str = "",
    rollback: bool = False,
    run: str = "",
    bucket_bytes: int,
    timeout_s: float,
    token: str | None,
) -> rollout_pb2.UpdateWeightsResponse:
    """One push whose buckets come from `buckets` (shared with other servers' pushes by a fan-out);
    `checksum()` is read once they are exhausted."""
    header = update_header(
        version, specs, rollback=rollback, run=run, bucket_bytes=bucket_bytes, checksum=header_checksum
    )

    async def messages():
        yield rollout_pb2.WeightChunk(header=header)
        async for bucket in buckets:
            yield rollout_pb2.WeightChunk(
                bucket=rollout_pb2.WeightBucket(
                    tensors=specs_to_proto(bucket.specs),
                    nbytes=bucket.nbytes,
                    sha256=bucket.sha256,
                    digest=bucket.digest,
                )
            )
            for start in range(0, bucket.nbytes, PUSH_CHUNK_BYTES):
                yield encoded_data_chunk(bucket.data[start : start + PUSH_CHUNK_BYTES])
        yield rollout_pb2.WeightChunk(commit=rollout_pb2.WeightCommit(checksum=checksum()))

    return await update_weights(channel, messages(), timeout_s=timeout_s, token=token)


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
