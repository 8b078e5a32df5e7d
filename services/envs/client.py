"""How callers (rollout, tests) reach the env service: one interface, in-process or over gRPC."""

from __future__ import annotations

import abc
import asyncio
import logging
from typing import Any

import grpc

from services.common import metrics
from services.common.errors import Internal, InvalidArgument, ServiceError, error_for, rpc_errors
from services.common.protos import envs_pb2, envs_pb2_grpc
from services.envs.messages import EnvInfo, EpisodeState, ToolCall, ToolResult, to_struct
from services.envs.service import EnvService

log = logging.getLogger(__name__)
STEP_BATCH_SIZE = metrics.histogram(
    "rollout",
    "env_step_batch_size",
    "Episode steps sent in one StepBatch call to the env service",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
)
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class EnvClient(abc.ABC):
    """Failures raise services.common.errors types (NotFound, InvalidArgument, ...)."""

    @abc.abstractmethod
    async def list_envs(self) -> list[EnvInfo]: ...

    @abc.abstractmethod
    async def create(self, env: str, task_index: int = 0, options: dict[str, Any] | None = None) -> EpisodeState:
        """A new episode, already reset to `task_index`."""

    async def create_batch(
        self, env: str, task_index: int = 0, options: dict[str, Any] | None = None, count: int = 1
    ) -> list[EpisodeState | ServiceError]:
        """`count` new episodes of one task (a group's), in one call where the service has one (bad
        arguments then raise, as `create`'s do); an episode that could not be built is its error in its
        place of the list. This default makes `count` single creates, concurrently, and returns every
        failure in its place."""
        results = await asyncio.gather(
            *(self.create(env, task_index, options) for _ in range(count)), return_exceptions=True
        )
        return _service_errors_only(results)

    @abc.abstractmethod
    async def reset(self, episode_id: str, task_index: int) -> EpisodeState: ...

    @abc.abstractmethod
    async def step(self, episode_id: str, action: str) -> EpisodeState:
        """`action` is the text inside <action>...</action>."""

    @abc.abstractmethod
    async def call_tools(self, episode_id: str, calls: list[ToolCall]) -> list[ToolResult]:
        """One model turn's tool calls, run concurrently; a call's failure is its result (`kind`), not an error."""

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

    async def create_batch(
        self, env: str, task_index: int = 0, options: dict[str, Any] | None = None, count: int = 1
    ) -> list[EpisodeState | ServiceError]:
        return await self.service.create_batch(env, task_index, options, count)

    async def reset(self, episode_id: str, task_index: int) -> EpisodeState:
        return await self.service.reset(episode_id, task_index)

    async def step(self, episode_id: str, action: str) -> EpisodeState:
        return await self.service.step(episode_id, action)

    async def call_tools(self, episode_id: str, calls: list[ToolCall]) -> list[ToolResult]:
        return await self.service.call_tools(episode_id, calls)

    async def close(self, episode_id: str) -> bool:
        return await self.service.close(episode_id)


class GrpcEnvClient(EnvClient):
    def __init__(
        self,
        address: str,
        timeout_s: float = 30.0,
        batch_steps: bool = False,
        batch_creates: bool = True,
        tools_timeout_s: float | None = None,
    ):
        """`timeout_s` bounds every call; keep it above the server's step timeout so a slow env is
        reported by the server (DEADLINE_EXCEEDED with the env's name) rather than cut off here.
        `address` may name several replicas (`ipv4:h1:p1,h2:p2`, or a DNS name with several records):
        calls are spread round-robin, and the replicas route each episode's calls to its owner.
        `batch_steps`: the steps asked for in one pass of the event loop (episodes whose replies came out
        of the same engine step) travel as one StepBatch call; a server without StepBatch gets single
        Steps from then on. `batch_creates`: `create_batch` is one CreateBatch call (a server without it
        gets single Creates from then on); false: single Creates always."""
        self.address, self.timeout_s, self.batch_steps = address, timeout_s, batch_steps
        self.tools_timeout_s = tools_timeout_s or timeout_s
        """The deadline of one CallTools (its calls may queue for sandbox slots: `EnvDeadlines.tools_client_s`)."""
        self.batch_creates = batch_creates
        self._channel: grpc.aio.Channel | None = None
        self._stub: envs_pb2_grpc.EnvServiceStub | None = None
        self._queued: list[tuple[envs_pb2.StepRequest, asyncio.Future]] = []
        self._senders: set[asyncio.Task] = set()

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

    async def create_batch(
        self, env: str, task_index: int = 0, options: dict[str, Any] | None = None, count: int = 1
    ) -> list[EpisodeState | ServiceError]:
        if not self.batch_creates:
            return await super().create_batch(env, task_index, options, count)
        create = _request(envs_pb2.CreateRequest, env=env, task_index=task_index, options=options)
        request = _request(envs_pb2.CreateBatchRequest, create=create, count=count)
        try:
            with rpc_errors():
                reply = await self.stub.CreateBatch(request, timeout=self.timeout_s)
        except ServiceError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.warning("the env service at %s has no CreateBatch: single creates from now on", self.address)
            self.batch_creates = False
            return await super().create_batch(env, task_index, options, count)
        if len(reply.results) != count:
            raise Internal(f"CreateBatch answered {len(reply.results)} results for {count} episodes")
        return [_state_or_error(result) for result in reply.results]

    async def reset(self, episode_id: str, task_index: int) -> EpisodeState:
        request = _request(envs_pb2.ResetRequest, episode_id=episode_id, task_index=task_index)
        with rpc_errors():
            return EpisodeState.from_proto(await self.stub.Reset(request, timeout=self.timeout_s))

    async def step(self, episode_id: str, action: str) -> EpisodeState:
        request = _request(envs_pb2.StepRequest, episode_id=episode_id, action=action)
        if not self.batch_steps:
            with rpc_errors():
                return EpisodeState.from_proto(await self.stub.Step(request, timeout=self.timeout_s))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._queued:  # runs after every episode that is ready in this pass has queued its step
            loop.call_soon(self._start_batch)
        self._queued.append((request, future))
        return await future

    def _start_batch(self) -> None:
        task = asyncio.ensure_future(self._send_batch())
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)

    async def _send_batch(self) -> None:
        batch, self._queued = self._queued, []
        STEP_BATCH_SIZE.observe(len(batch))
        try:
            with rpc_errors():
                reply = await self.stub.StepBatch(
                    envs_pb2.StepBatchRequest(steps=[request for request, _ in batch]), timeout=self.timeout_s
                )
        except ServiceError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("the env service at %s has no StepBatch: single steps from now on", self.address)
                self.batch_steps = False
                await asyncio.gather(*(self._single(request, future) for request, future in batch))
                return
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException as exc:  # cancelled, or a bug: no episode may wait forever on its step
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc if isinstance(exc, Exception) else ServiceError(str(exc)))
            raise
        if len(reply.results) != len(batch):
            error = Internal(f"StepBatch answered {len(reply.results)} results for {len(batch)} steps")
            results = [envs_pb2.StepResult(code=error.code.value[0], error=error.message)] * len(batch)
        else:
            results = list(reply.results)
        for (_, future), result in zip(batch, results):
            if future.done():  # the episode was cancelled meanwhile
                continue
            outcome = _state_or_error(result)
            if isinstance(outcome, ServiceError):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    async def _single(self, request: envs_pb2.StepRequest, future: asyncio.Future) -> None:
        try:
            with rpc_errors():
                state = EpisodeState.from_proto(await self.stub.Step(request, timeout=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - handed to the episode that asked
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(state)

    async def call_tools(self, episode_id: str, calls: list[ToolCall]) -> list[ToolResult]:
        request = envs_pb2.CallToolsRequest(episode_id=episode_id, calls=[call.to_proto() for call in calls])
        with rpc_errors():
            reply = await self.stub.CallTools(request, timeout=self.tools_timeout_s)
        if len(reply.results) != len(calls):
            raise Internal(f"CallTools answered {len(reply.results)} results for {len(calls)} calls")
        return [ToolResult.from_proto(result) for result in reply.results]

    async def close(self, episode_id: str) -> bool:
        with rpc_errors():
            reply = await self.stub.Close(envs_pb2.CloseRequest(episode_id=episode_id), timeout=self.timeout_s)
        return reply.closed

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


def _state_or_error(result: envs_pb2.StepResult) -> EpisodeState | ServiceError:
    if result.code:
        return error_for(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.error)
    return EpisodeState.from_proto(result.state)


def _service_errors_only(results: list[Any]) -> list[EpisodeState | ServiceError]:
    """gather(return_exceptions=True) results, with any exception that is not a ServiceError raised."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, ServiceError):
            raise result
    return results


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
