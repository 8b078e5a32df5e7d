"""gRPC shell around RolloutCore."""

from __future__ import annotations

import logging
import uuid

from services.common.errors import InvalidArgument, ServiceError, Unauthenticated
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.common.weights import CHUNK_BYTES, PayloadBuffer, TensorSpec, WeightSetRejected
from services.rollout.backends.base import SamplingSpec
from services.rollout.core import PUSHES_REFUSED, PushHeader, RolloutCore
from services.rollout.push_auth import PushAuthenticator

log = logging.getLogger(__name__)


def sampling_from_proto(p: rollout_pb2.SamplingParams) -> SamplingSpec:
    if p.max_tokens == 0:
        raise InvalidArgument("sampling.max_tokens must be positive")
    return SamplingSpec(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p or 1.0,
        top_k=max(p.top_k, 0),
        stop_token_ids=list(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
    )


def header_from_proto(h: rollout_pb2.WeightUpdateHeader) -> PushHeader:
    specs = [TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in h.tensors]
    return PushHeader(h.version, specs, h.checksum, rollback=h.rollback, run=h.run)


def _invalid(message: str) -> InvalidArgument:
    PUSHES_REFUSED.labels("invalid").inc()
    log.warning("weight push refused: %s", message)
    return InvalidArgument(f"weight set rejected, nothing applied: {message}")


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, core: RolloutCore, auth: PushAuthenticator):
        self.core, self.auth = core, auth

    async def Generate(self, request, context):
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids is empty")
        out = await self.core.generate(
            request.request_id or uuid.uuid4().hex,
            list(request.prompt_token_ids),
            sampling_from_proto(request.sampling),
        )
        g = out.generation
        return rollout_pb2.GenerateResponse(
            token_ids=g.token_ids, logprobs=g.logprobs, finish_reason=g.finish_reason, policy_version=out.policy_version
        )

    async def UpdateWeights(self, request_iterator, context):
        """Authenticates before reading anything, checks the header before reading data, and cuts off a
        stream that sends more bytes than its header declared.

        A push refused at its header is read to its end (discarded, up to one model's size) before the
        answer: grpcio's asyncio client reports INTERNAL "Internal error from Core" instead of the
        server's status when the call ends while it is still sending (grpc/grpc#36066), and a learner
        should see why its push was refused. A stream past that size is cut off at once."""
        try:
            try:
                self.auth.check(context.invocation_metadata() or (), peer=context.peer())
            except Unauthenticated:
                PUSHES_REFUSED.labels("unauthenticated").inc()
                raise
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("payload") != "header":
                raise _invalid("a weight update starts with its header")
            header = header_from_proto(first.header)
            already_served = self.core.admit(header)
        except ServiceError:
            await self._discard_rest(request_iterator)
            raise
        if already_served:
            await self._discard_rest(request_iterator)
            return self._reply(header.version, header.checksum, 0, 0.0)
        buffer = PayloadBuffer(header.declared_bytes)
        async for chunk in request_iterator:
            if chunk.WhichOneof("payload") != "data":
                raise _invalid("a weight update carries exactly one header")
            try:
                buffer.add(chunk.data)
            except WeightSetRejected as exc:
                raise _invalid(str(exc)) from exc
        result = await self.core.update_weights(header, buffer.payload())
        return self._reply(result.policy_version, result.checksum, result.bytes_received, result.apply_seconds)

    async def _discard_rest(self, request_iterator) -> None:
        limit = (self.core.signature.total_bytes if self.core.signature else 0) + CHUNK_BYTES
        seen = 0
        async for chunk in request_iterator:
            seen += chunk.ByteSize()
            if seen > limit:
                return

    @staticmethod
    def _reply(version: int, checksum: str, received: int, seconds: float) -> rollout_pb2.UpdateWeightsResponse:
        return rollout_pb2.UpdateWeightsResponse(
            policy_version=version, checksum=checksum, bytes_received=received, apply_seconds=seconds
        )

    async def GetStatus(self, request, context):
        return rollout_pb2.RolloutStatus(**self.core.status())


def add_to_server(core: RolloutCore, auth: PushAuthenticator):
    return lambda server: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(core, auth), server)
