"""The gRPC shell around EnvService: protos in, protos out, errors raised (the interceptor maps them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from services.common.errors import ServiceError
from services.common.protos import envs_pb2, envs_pb2_grpc
from services.envs.messages import ToolCall, from_struct
from services.envs.replicas import FORWARDED, RoutedEnvService
from services.envs.service import EnvService

log = logging.getLogger(__name__)


def _forwarded(context) -> bool:
    return any(key == FORWARDED for key, _ in (context.invocation_metadata() or ()))


class EnvServicer(envs_pb2_grpc.EnvServiceServicer):
    def __init__(self, service: EnvService | RoutedEnvService):
        self.service = service if isinstance(service, RoutedEnvService) else RoutedEnvService(service)

    async def ListEnvs(self, request: envs_pb2.ListEnvsRequest, context) -> envs_pb2.ListEnvsResponse:
        return envs_pb2.ListEnvsResponse(envs=[info.to_proto() for info in await self.service.list_envs()])

    async def Create(self, request: envs_pb2.CreateRequest, context) -> envs_pb2.EpisodeState:
        state = await self.service.create(request.env, request.task_index, from_struct(request.options))
        return state.to_proto()

    async def CreateBatch(self, request: envs_pb2.CreateBatchRequest, context) -> envs_pb2.CreateBatchResponse:
        create = request.create
        results = await self.service.create_batch(
            create.env, create.task_index, from_struct(create.options), request.count
        )
        return envs_pb2.CreateBatchResponse(results=[_step_result(result) for result in results])

    async def Reset(self, request: envs_pb2.ResetRequest, context) -> envs_pb2.EpisodeState:
        return (await self.service.reset(request.episode_id, request.task_index, _forwarded(context))).to_proto()

    async def Step(self, request: envs_pb2.StepRequest, context) -> envs_pb2.EpisodeState:
        return (await self.service.step(request.episode_id, request.action, _forwarded(context))).to_proto()

    async def StepBatch(self, request: envs_pb2.StepBatchRequest, context) -> envs_pb2.StepBatchResponse:
        """Every step runs as its own Step would (concurrently, each with its episode's lock and deadline)."""
        forwarded = _forwarded(context)
        results = await asyncio.gather(
            *(self.service.step(step.episode_id, step.action, forwarded) for step in request.steps),
            return_exceptions=True,
        )
        return envs_pb2.StepBatchResponse(results=[_step_result(result) for result in results])

    async def CallTools(self, request: envs_pb2.CallToolsRequest, context) -> envs_pb2.CallToolsResponse:
        calls = [ToolCall.from_proto(call) for call in request.calls]
        results = await self.service.call_tools(
            request.episode_id, calls, _forwarded(context), time_left=context.time_remaining()
        )
        return envs_pb2.CallToolsResponse(results=[result.to_proto() for result in results])

    async def Close(self, request: envs_pb2.CloseRequest, context) -> envs_pb2.CloseResponse:
        return envs_pb2.CloseResponse(closed=await self.service.close(request.episode_id, _forwarded(context)))


def _step_result(result) -> envs_pb2.StepResult:
    """One episode's outcome in a batch reply: its state, or its failure's code and message."""
    if isinstance(result, ServiceError):
        return envs_pb2.StepResult(code=result.code.value[0], error=result.message)
    if isinstance(result, BaseException):
        if isinstance(result, asyncio.CancelledError):
            raise result
        log.error("a call in a batch failed: %s: %s", type(result).__name__, result)
        return envs_pb2.StepResult(code=grpc.StatusCode.INTERNAL.value[0], error=f"{type(result).__name__}: {result}")
    return envs_pb2.StepResult(state=result.to_proto())


def add_env_service(service: EnvService | RoutedEnvService) -> Callable[[grpc.aio.Server], None]:
    return lambda server: envs_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(service), server)
