"""Several env-service replicas behind one address.

An episode lives in the memory of the replica that created it, so every call for it must reach that
replica, whatever a load balancer in front does with each call. Design: an episode id names its owner
(`<replica id>.<random hex>`); each replica knows the direct address of its peers from a directory
(Redis, refreshed by heartbeat, or a static `id=address` list, e.g. a StatefulSet's stable names); a
replica that receives a call for a peer's episode forwards it to the owner's direct address, marked
as forwarded so it is never forwarded twice. A call for an episode whose owner is gone (not in the
directory, or not answering) fails with UNAVAILABLE: the episode is lost, and the rollout retries it
on a fresh environment. Clients need no knowledge of replicas, and any balancer, per-connection or
per-call (gRPC round_robin, Envoy, a Kubernetes Service), works; a misrouted call costs one extra
hop between replicas.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import time
from typing import Any

import grpc

from services.common import metrics
from services.common.errors import NotFound, ServiceError, Unavailable, rpc_errors
from services.common.protos import envs_pb2, envs_pb2_grpc
from services.envs.messages import EnvInfo, EpisodeState, ToolCall, ToolResult
from services.envs.service import EnvService, owner_of

log = logging.getLogger(__name__)
FORWARDED = "omrl-forwarded"
"""gRPC metadata key set on calls one replica forwards to another."""


class ReplicaDirectory(abc.ABC):
    """Where each replica can be reached directly."""

    @abc.abstractmethod
    async def address_of(self, replica_id: str) -> str | None: ...

    async def register(self, replica_id: str, address: str) -> None:
        """Announces this replica (called periodically)."""

    async def unregister(self, replica_id: str) -> None: ...


class StaticDirectory(ReplicaDirectory):
    def __init__(self, peers: dict[str, str]):
        self.peers = dict(peers)

    async def address_of(self, replica_id: str) -> str | None:
        return self.peers.get(replica_id)


class RedisDirectory(ReplicaDirectory):
    """A Redis hash `<key>`: replica id -> {"address", "ts"}; entries older than `max_age_s` are dead.
    `client` is a `redis.asyncio` client."""

    def __init__(self, client: Any, key: str, max_age_s: float = 15.0):
        self.client, self.key, self.max_age_s = client, key, max_age_s

    async def address_of(self, replica_id: str) -> str | None:
        raw = await self.client.hget(self.key, replica_id)
        if raw is None:
            return None
        entry = json.loads(raw)
        return entry["address"] if time.time() - entry.get("ts", 0) <= self.max_age_s else None

    async def register(self, replica_id: str, address: str) -> None:
        await self.client.hset(self.key, replica_id, json.dumps({"address": address, "ts": time.time()}))

    async def unregister(self, replica_id: str) -> None:
        await self.client.hdel(self.key, replica_id)


class RoutedEnvService:
    """What the gRPC shell serves: local episodes from the local EnvService, a peer's episodes
    forwarded to that peer. Same methods as EnvService, plus `forwarded` on episode calls."""

    def __init__(self, local: EnvService, directory: ReplicaDirectory | None = None, timeout_s: float = 30.0):
        self.local, self.directory, self.timeout_s = local, directory, timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._m_forwarded = metrics.counter(
            "envs",
            "forwarded_calls_total",
            "Episode calls forwarded to the replica that holds the episode",
            ["op", "outcome"],
            registry=local.metrics_registry,
        )

    @property
    def replica_id(self) -> str:
        return self.local.replica_id

    async def list_envs(self) -> list[EnvInfo]:
        return await self.local.list_envs()

    async def create(self, env: str, task_index: int = 0, options: dict[str, Any] | None = None) -> EpisodeState:
        return await self.local.create(env, task_index, options)

    async def create_batch(
        self, env: str, task_index: int = 0, options: dict[str, Any] | None = None, count: int = 1
    ) -> list[EpisodeState | ServiceError]:
        return await self.local.create_batch(env, task_index, options, count)

    async def reset(self, episode_id: str, task_index: int, forwarded: bool = False) -> EpisodeState:
        if self._is_local(episode_id, forwarded):
            return await self.local.reset(episode_id, task_index)
        reply = await self._forward(
            "Reset", episode_id, envs_pb2.ResetRequest(episode_id=episode_id, task_index=task_index)
        )
        return EpisodeState.from_proto(reply)

    async def step(self, episode_id: str, action: str, forwarded: bool = False) -> EpisodeState:
        if self._is_local(episode_id, forwarded):
            return await self.local.step(episode_id, action)
        reply = await self._forward("Step", episode_id, envs_pb2.StepRequest(episode_id=episode_id, action=action))
        return EpisodeState.from_proto(reply)

    async def call_tools(
        self, episode_id: str, calls: list[ToolCall], forwarded: bool = False, time_left: float | None = None
    ) -> list[ToolResult]:
        if self._is_local(episode_id, forwarded):
            return await self.local.call_tools(episode_id, calls, time_left)
        request = envs_pb2.CallToolsRequest(episode_id=episode_id, calls=[call.to_proto() for call in calls])
        reply = await self._forward("CallTools", episode_id, request)
        return [ToolResult.from_proto(result) for result in reply.results]

    async def close(self, episode_id: str, forwarded: bool = False) -> bool:
        if self._is_local(episode_id, forwarded):
            return await self.local.close(episode_id)
        reply = await self._forward("Close", episode_id, envs_pb2.CloseRequest(episode_id=episode_id))
        return reply.closed

    def _is_local(self, episode_id: str, forwarded: bool) -> bool:
        owner = owner_of(episode_id)
        if owner is None or owner == self.replica_id or self.directory is None:
            return True  # the local service answers NOT_FOUND for ids it does not hold
        if forwarded:
            # the directory sent a forwarded call to a replica that does not own it: a restarted
            # replica at the same address, say; forwarding again could loop
            raise NotFound(f"episode {episode_id} belongs to replica {owner}, not {self.replica_id}")
        return False

    async def _forward(self, method: str, episode_id: str, request: Any) -> Any:
        owner = owner_of(episode_id)
        address = await self.directory.address_of(owner)
        if address is None:
            self._m_forwarded.labels(method, "owner_gone").inc()
            raise Unavailable(f"episode {episode_id} was held by env replica {owner}, which is gone")
        stub = envs_pb2_grpc.EnvServiceStub(self._channel(address))
        try:
            with rpc_errors():
                reply = await getattr(stub, method)(request, timeout=self.timeout_s, metadata=((FORWARDED, "1"),))
        except Unavailable as exc:
            self._m_forwarded.labels(method, "owner_unreachable").inc()
            raise Unavailable(
                f"episode {episode_id}: env replica {owner} at {address} is unreachable ({exc.message})"
            ) from None
        except ServiceError as exc:
            self._m_forwarded.labels(method, type(exc).__name__).inc()
            raise
        self._m_forwarded.labels(method, "ok").inc()
        return reply

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address)
        return self._channels[address]

    async def aclose(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await self.local.aclose()


async def heartbeat(directory: ReplicaDirectory, replica_id: str, address: str, every_s: float = 2.0) -> None:
    while True:
        try:
            await directory.register(replica_id, address)
        except Exception as exc:  # noqa: BLE001 - a Redis blip must not stop the replica; peers retry
            log.warning("replica heartbeat failed: %s", exc)
        await asyncio.sleep(every_s)
