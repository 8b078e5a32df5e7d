"""The gRPC shell around EnvService: protos in, protos out, errors raised (the interceptor maps them)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.common.protos import envs_pb2, envs_pb2_grpc
from services.envs.messages import from_struct
from services.envs.replicas import FORWARDED, RoutedEnvService
from services.envs.service import EnvService


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

    async def Reset(self, request: envs_pb2.ResetRequest, context) -> envs_pb2.EpisodeState:
        return (await self.service.reset(request.episode_id, request.task_index, _forwarded(context))).to_proto()

    async def Step(self, request: envs_pb2.StepRequest, context) -> envs_pb2.EpisodeState:
        return (await self.service.step(request.episode_id, request.action, _forwarded(context))).to_proto()

    async def Close(self, request: envs_pb2.CloseRequest, context) -> envs_pb2.CloseResponse:
        return envs_pb2.CloseResponse(closed=await self.service.close(request.episode_id, _forwarded(context)))


def add_env_service(service: EnvService | RoutedEnvService) -> Callable[[grpc.aio.Server], None]:
    return lambda server: envs_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(service), server)
