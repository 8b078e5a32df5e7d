"""The gRPC shell around EnvService: protos in, protos out, errors raised (the interceptor maps them)."""
from __future__ import annotations

from typing import Callable

import grpc

from services.common.protos import envs_pb2, envs_pb2_grpc
from services.envs.messages import from_struct
from services.envs.service import EnvService


class EnvServicer(envs_pb2_grpc.EnvServiceServicer):
    def __init__(self, service: EnvService):
        self.service = service

    async def ListEnvs(self, request: envs_pb2.ListEnvsRequest, context) -> envs_pb2.ListEnvsResponse:
        return envs_pb2.ListEnvsResponse(envs=[info.to_proto() for info in await self.service.list_envs()])

    async def Create(self, request: envs_pb2.CreateRequest, context) -> envs_pb2.EpisodeState:
        state = await self.service.create(request.env, request.task_index, from_struct(request.options))
        return state.to_proto()

    async def Reset(self, request: envs_pb2.ResetRequest, context) -> envs_pb2.EpisodeState:
        return (await self.service.reset(request.episode_id, request.task_index)).to_proto()

    async def Step(self, request: envs_pb2.StepRequest, context) -> envs_pb2.EpisodeState:
        return (await self.service.step(request.episode_id, request.action)).to_proto()

    async def Close(self, request: envs_pb2.CloseRequest, context) -> envs_pb2.CloseResponse:
        return envs_pb2.CloseResponse(closed=await self.service.close(request.episode_id))


def add_env_service(service: EnvService) -> Callable[[grpc.aio.Server], None]:
    return lambda server: envs_pb2_grpc.add_EnvServiceServicer_to_server(EnvServicer(service), server)
