"""Callers of a rollout server: the gRPC client used in production and an in-process one for tests."""

from __future__ import annotations

import abc
from collections.abc import Sequence

import grpc

from services.common.errors import rpc_errors
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.common.weights import PackedWeights
from services.rollout.backends.base import Generation, SamplingSpec
from services.rollout.core import PushHeader, RolloutCore, UpdateResult, VersionedGeneration
from services.rollout.push_auth import auth_metadata


class RolloutClient(abc.ABC):
    @abc.abstractmethod
    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingSpec
    ) -> VersionedGeneration: ...

    @abc.abstractmethod
    async def update_weights(
        self, version: int, weights: PackedWeights, *, rollback: bool = False, run: str = ""
    ) -> UpdateResult: ...

    @abc.abstractmethod
    async def status(self) -> dict: ...

    async def close(self) -> None:
        pass


class InProcessRolloutClient(RolloutClient):
    def __init__(self, core: RolloutCore):
        self.core = core

    async def generate(self, request_id, prompt_ids, sampling):
        return await self.core.generate(request_id, prompt_ids, sampling)

    async def update_weights(self, version, weights, *, rollback=False, run=""):
        header = PushHeader(version, weights.specs, weights.checksum, rollback=rollback, run=run)
        return await self.core.update_weights(header, weights.payload)

    async def status(self):
        return self.core.status()


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

    async def update_weights(self, version, weights, *, rollback=False, run=""):
        packed = weights
        header = rollout_pb2.WeightUpdateHeader(
            version=version,
            checksum=packed.checksum,
            rollback=rollback,
            run=run,
            tensors=[
                rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes) for s in packed.specs
            ],
        )

        async def chunks():
            yield rollout_pb2.WeightChunk(header=header)
            for data in packed.chunks():
                yield rollout_pb2.WeightChunk(data=data)

        with rpc_errors():
            reply = await self.stub.UpdateWeights(
                chunks(), timeout=self.push_timeout_s, metadata=auth_metadata(self.weight_token)
            )
        return UpdateResult(reply.policy_version, reply.checksum, reply.bytes_received, reply.apply_seconds)

    async def status(self):
        with rpc_errors():
            reply = await self.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=self.timeout_s)
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    async def close(self):
        if self._channel is not None:
            await self._channel.close()
