"""gRPC shell around RolloutCore."""
from __future__ import annotations

import uuid

from services.common.errors import InvalidArgument
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.common.weights import ChecksumMismatch, TensorSpec
from services.rollout.backends.base import SamplingSpec
from services.rollout.core import RolloutCore


def sampling_from_proto(p: rollout_pb2.SamplingParams) -> SamplingSpec:
    if p.max_tokens == 0:
        raise InvalidArgument("sampling.max_tokens must be positive")
    return SamplingSpec(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p or 1.0,
                        top_k=max(p.top_k, 0), stop_token_ids=list(p.stop_token_ids),
                        seed=p.seed if p.HasField("seed") else None)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, core: RolloutCore):
        self.core = core

    async def Generate(self, request, context):
        if not request.prompt_token_ids:
            raise InvalidArgument("prompt_token_ids is empty")
        out = await self.core.generate(request.request_id or uuid.uuid4().hex, list(request.prompt_token_ids),
                                       sampling_from_proto(request.sampling))
        g = out.generation
        return rollout_pb2.GenerateResponse(token_ids=g.token_ids, logprobs=g.logprobs,
                                            finish_reason=g.finish_reason, policy_version=out.policy_version)

    async def UpdateWeights(self, request_iterator, context):
        header, parts = None, []
        async for chunk in request_iterator:
            kind = chunk.WhichOneof("payload")
            if kind == "header":
                if header is not None:
                    raise InvalidArgument("a weight update carries exactly one header")
                header = chunk.header
            elif kind == "data":
                if header is None:
                    raise InvalidArgument("weight data arrived before the header")
                parts.append(chunk.data)
        if header is None:
            raise InvalidArgument("weight update without a header")
        specs = [TensorSpec(t.name, t.dtype, tuple(t.shape), t.nbytes) for t in header.tensors]
        try:
            result = await self.core.update_weights(header.version, specs, b"".join(parts), header.checksum)
        except ChecksumMismatch as exc:
            raise InvalidArgument(f"weight set rejected, nothing applied: {exc}") from exc
        return rollout_pb2.UpdateWeightsResponse(policy_version=result.policy_version, checksum=result.checksum,
                                                 bytes_received=result.bytes_received,
                                                 apply_seconds=result.apply_seconds)

    async def GetStatus(self, request, context):
        return rollout_pb2.RolloutStatus(**self.core.status())


def add_to_server(core: RolloutCore):
    return lambda server: rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(core), server)
