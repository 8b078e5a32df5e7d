"""How callers (rollout, tests) reach the env service: one interface, in-process or over gRPC."""

from __future__ import annotations

import abc
from typing import Any

import grpc

from services.common.errors import InvalidArgument, rpc_errors
from services.common.protos import envs_pb2, envs_pb2_grpc
from services.envs.messages import EnvInfo, EpisodeState, to_struct
from services.envs.service import EnvService


class EnvClient(abc.ABC):
    """Failures raise services.common.errors types (NotFound, InvalidArgument, ...)."""

    @abc.abstractmethod
    async def list_envs(self) -> list[EnvInfo]: ...

    @abc.abstractmethod
    async def create(self, env: str, task_index: int = 0, options: dict[str, Any] | None = None) -> EpisodeState:
        """A new episode, already reset to `task_index`."""

    @abc.abstractmethod
    async def reset(self, episode_id: str, task_index: int) -> EpisodeState: ...

    @abc.abstractmethod
    async def step(self, episode_id: str, action: str) -> EpisodeState:
        """`action` is the text inside <action>...</action>."""

    @abc.abstractmethod
    async def close(self, episode_id: str) -> bool:
        """Ends the episode; False if there was none."""

    async def aclose(self) -> None:
        """Releases the client's own resources (not the service's)."""

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class InProcessEnvClient(EnvClient):
    def __init__(self, service: EnvService):
        self.service = service

    async def list_envs(self) -> list[EnvInfo]:
        return await self.service.list_envs()

    async def create(self, env: str, task_index: int = 0, options: dict[str, Any] | None = None) -> EpisodeState:
        return await self.service.create(env, task_index, options)

    async def reset(self, episode_id: str, task_index: int) -> EpisodeState:
        return await self.service.reset(episode_id, task_index)

    async def step(self, episode_id: str, action: str) -> EpisodeState:
        return await self.service.step(episode_id, action)

    async def close(self, episode_id: str) -> bool:
        return await self.service.close(episode_id)


class GrpcEnvClient(EnvClient):
    def __init__(self, address: str, timeout_s: float = 30.0):
        """`timeout_s` bounds every call; keep it above the server's step timeout so a slow env is
        reported by the server (DEADLINE_EXCEEDED with the env's name) rather than cut off here.
        `address` may name several replicas (`ipv4:h1:p1,h2:p2`, or a DNS name with several records):
        calls are spread round-robin, and the replicas route each episode's calls to its owner."""
        self.address, self.timeout_s = address, timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: envs_pb2_grpc.EnvServiceStub | None = None

    @property
    def stub(self) -> envs_pb2_grpc.EnvServiceStub:
        # created on first use so it binds to the running event loop
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=[("grpc.lb_policy_name", "round_robin")])
            self._stub = envs_pb2_grpc.EnvServiceStub(self._channel)
        return self._stub

    async def list_envs(self) -> list[EnvInfo]:
        with rpc_errors():
            reply = await self.stub.ListEnvs(envs_pb2.ListEnvsRequest(), timeout=self.timeout_s)
        return [EnvInfo.from_proto(info) for info in reply.envs]

    async def create(self, env: str, task_index: int = 0, options: dict[str, Any] | None = None) -> EpisodeState:
        request = _request(envs_pb2.CreateRequest, env=env, task_index=task_index, options=options)
        with rpc_errors():
            return EpisodeState.from_proto(await self.stub.Create(request, timeout=self.timeout_s))

    async def reset(self, episode_id: str, task_index: int) -> EpisodeState:
        request = _request(envs_pb2.ResetRequest, episode_id=episode_id, task_index=task_index)
        with rpc_errors():
            return EpisodeState.from_proto(await self.stub.Reset(request, timeout=self.timeout_s))

    async def step(self, episode_id: str, action: str) -> EpisodeState:
        request = _request(envs_pb2.StepRequest, episode_id=episode_id, action=action)
        with rpc_errors():
            return EpisodeState.from_proto(await self.stub.Step(request, timeout=self.timeout_s))

    async def close(self, episode_id: str) -> bool:
        with rpc_errors():
            reply = await self.stub.Close(envs_pb2.CloseRequest(episode_id=episode_id), timeout=self.timeout_s)
        return reply.closed

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


def _request(message: type, **fields: Any) -> Any:
    """Bad arguments fail as InvalidArgument here too, as they do in process."""
    try:
        if "options" in fields:
            if fields["options"] is not None and not isinstance(fields["options"], dict):
                raise TypeError(f"options must be a mapping, got {type(fields['options']).__name__}")
            fields["options"] = to_struct(fields["options"])
        return message(**fields)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{message.__name__}: {exc}") from None
