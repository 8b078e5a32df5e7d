"""gRPC shell around RolloutCore."""

from __future__ import annotations

import contextlib
import logging
import uuid

from services.common.errors import InvalidArgument, ServiceError, Unauthenticated
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.engines.base import SamplingSpec
from services.rollout.core import PUSHES_REFUSED, PushHeader, RolloutCore
from services.weightsync.credential import PushAuthenticator
from services.weightsync.wire import CHUNK_BYTES, TensorSpec

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


def specs_from_proto(tensors) -> list[TensorSpec]:
    return [TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in tensors]


def header_from_proto(h: rollout_pb2.WeightUpdateHeader) -> PushHeader:
    return PushHeader(
        h.version,
        specs_from_proto(h.tensors),
        h.checksum,
        rollback=h.rollback,
        run=h.run,
        bucket_bytes=h.bucket_bytes,
        total_bytes=h.total_bytes,
    )


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
        """Authenticates before reading anything, checks the header before reading data, checks each
        bucket as it arrives (`weightsync.grpc.receive`) and applies the set only at a commit that verifies; a
        stream that ends or breaks before it applies nothing.

        A push refused at its header is read to its end (discarded, up to one model's size) before the
        answer: grpcio's asyncio client reports INTERNAL "Internal error from Core" instead of the
        server's status when the call ends while it is still sending (grpc/grpc#36066), and a learner
        should see why its push was refused. A bucket refused midway is answered at once."""
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
            receiver = None if first.header.HasField("dist") else self.core.begin_push(header)
        except ServiceError:
            await self._discard_rest(request_iterator)
            raise
        if first.header.HasField("dist"):
            return await self._update_weights_nccl(header, first.header.dist, request_iterator)
        if receiver is None:
            await self._discard_rest(request_iterator)
            return self._reply(self.core.policy_version, self.core.weights_checksum, 0, 0.0)
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("payload")
                if kind == "data":
                    await self.core.receive(header, receiver, receiver.add_data, message.data)
                elif kind == "bucket":
                    b = message.bucket
                    specs = specs_from_proto(b.tensors)
                    check = b.digest or b.sha256  # a `set-sha256:` digest, or (older senders) the sha256
                    await self.core.receive(header, receiver, receiver.start_bucket, specs, b.nbytes, check)
                elif kind == "commit":
                    result = await self.core.commit_push(header, receiver, message.commit.checksum)
                    return self._reply(
                        result.policy_version, result.checksum, result.bytes_received, result.apply_seconds
                    )
                elif kind == "header":
                    raise _invalid("a weight update carries exactly one header")
                else:
                    raise _invalid(f"a push with data chunks carries no {kind}")
            raise _invalid("the push ended before its commit")
        finally:
            receiver.abort()  # a no-op once the commit handed the spool over

    async def _update_weights_nccl(self, header, rdv, request_iterator):
        """An `nccl` push: this stream carries the control (bucket declarations with their digests, or the
        digests after them where `digests_follow`, the commit); the bytes come by broadcast to the engine's
        workers, each bucket received, checked and staged while its declaration is handled. The header's
        rendezvous is its `dist` field (`WeightDistRendezvous`: the proto keeps that name for compatibility)."""
        rendezvous = {
            "host": rdv.host,
            "port": rdv.port,
            "group": rdv.group,
            "backend": rdv.backend,
            "timeout_s": rdv.timeout_s,
        }
        staging = await self.core.begin_nccl_push(header, rendezvous, digests_follow=rdv.digests_follow)
        if staging is None:
            return self._reply(self.core.policy_version, self.core.weights_checksum, 0, 0.0)
        checksum = None
        try:
            async for message in request_iterator:
                kind = message.WhichOneof("payload")
                if kind == "bucket":
                    b = message.bucket
                    await self.core.receive_nccl(header, staging, specs_from_proto(b.tensors), b.nbytes, b.digest)
                elif kind == "bucket_digest":
                    self.core.receive_nccl_digest(header, staging, message.bucket_digest)
                elif kind == "commit":
                    checksum = message.commit.checksum
                    break
                else:
                    raise _invalid(f"an nccl push carries bucket declarations, their digests and a commit, not {kind}")
        except BaseException as exc:  # refused, broken or cancelled: drop the group, delete the spool
            with contextlib.suppress(ServiceError):
                await self.core.end_nccl_push(header, staging, None)
            if isinstance(exc, ServiceError):  # answered once the learner, its broadcast failed, ends its stream
                with contextlib.suppress(Exception):
                    await self._discard_rest(request_iterator)
            raise
        result = await self.core.end_nccl_push(header, staging, checksum)
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
