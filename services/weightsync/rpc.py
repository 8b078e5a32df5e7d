"""The rollout service's UpdateWeights call as a pusher makes it, whatever the transport: a `grpc` push
streams the buckets' bytes in it, an `nccl` push only its control (the bytes go by broadcast). The tensor
specs as protobuf, and one call with the push credential (`credential.auth_metadata`) as metadata."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from services.common.errors import rpc_errors
from services.common.protos import rollout_pb2
from services.weightsync.credential import auth_metadata
from services.weightsync.wire import TensorSpec

UPDATE_WEIGHTS = "/openmanus.rollout.v1.RolloutService/UpdateWeights"


def specs_to_proto(specs: Sequence[TensorSpec]) -> list:
    return [rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes) for s in specs]


def update_header(
    version: int, specs: Sequence[TensorSpec], *, rollback: bool, run: str, bucket_bytes: int, **fields
) -> rollout_pb2.WeightUpdateHeader:
    """The first message of every push; `fields`: the transport's own (a `grpc` push's checksum, an `nccl`
    push's rendezvous)."""
    return rollout_pb2.WeightUpdateHeader(
        version=version,
        rollback=rollback,
        run=run,
        total_bytes=sum(s.nbytes for s in specs),
        bucket_bytes=bucket_bytes,
        tensors=specs_to_proto(specs),
        **fields,
    )


def _serialize(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


async def update_weights(
    channel: grpc.aio.Channel, messages: AsyncIterator, *, timeout_s: float, token: str | None
) -> rollout_pb2.UpdateWeightsResponse:
    """One UpdateWeights call on `channel`: `messages` yields `WeightChunk`s, or data chunks already
    encoded (`grpc.send.encoded_data_chunk`); a refusal raises the matching `ServiceError`."""
    update = channel.stream_unary(
        UPDATE_WEIGHTS,
        request_serializer=_serialize,
        response_deserializer=rollout_pb2.UpdateWeightsResponse.FromString,
    )
    with rpc_errors():
        return await update(messages, timeout=timeout_s, metadata=auth_metadata(token))
