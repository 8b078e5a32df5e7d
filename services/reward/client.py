"""How callers (rollout, tests) reach the reward service: one interface, in-process or over gRPC."""

from __future__ import annotations

import abc
import asyncio
import math
from collections.abc import Sequence

import grpc

from services.common.errors import Internal, rpc_errors
from services.common.protos import reward_pb2, reward_pb2_grpc, trajectory_pb2
from services.reward.composer import Scored
from services.reward.service import RewardService, Score

MAX_REQUEST_BYTES = 32 * 2**20


class RewardClient(abc.ABC):
    @abc.abstractmethod
    async def score(self, trajectories: Sequence[trajectory_pb2.Trajectory]) -> list[Score]:
        """One Scored (total, {component: weighted value}, per-turn process rewards) per trajectory, in order."""

    async def aclose(self) -> None:
        """Releases the client's own resources."""

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class InProcessRewardClient(RewardClient):
    def __init__(self, service: RewardService):
        self.service = service

    async def score(self, trajectories: Sequence[trajectory_pb2.Trajectory]) -> list[Score]:
        return await self.service.score(trajectories)


class GrpcRewardClient(RewardClient):
    def __init__(self, address: str, timeout_s: float = 30.0, max_request_bytes: int = MAX_REQUEST_BYTES):
        self.address, self.timeout_s, self.max_request_bytes = address, timeout_s, max_request_bytes
        self._channel: grpc.aio.Channel | None = None
        self._stub: reward_pb2_grpc.RewardServiceStub | None = None

    @property
    def stub(self) -> reward_pb2_grpc.RewardServiceStub:
        if self._stub is None:  # created on first use so it binds to the running event loop
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = reward_pb2_grpc.RewardServiceStub(self._channel)
        return self._stub

    async def score(self, trajectories: Sequence[trajectory_pb2.Trajectory]) -> list[Score]:
        # long trajectories carry every token id and logprob: split so no request exceeds the limit
        chunks = await asyncio.gather(*(self._score(chunk) for chunk in self._chunks(trajectories)))
        return [score for chunk in chunks for score in chunk]

    async def _score(self, trajectories: list[trajectory_pb2.Trajectory]) -> list[Score]:
        with rpc_errors():
            reply = await self.stub.Score(reward_pb2.ScoreRequest(trajectories=trajectories), timeout=self.timeout_s)
        if len(reply.rewards) != len(trajectories):
            raise Internal(f"sent {len(trajectories)} trajectories, got {len(reply.rewards)} scores")
        return [_checked(r, traj) for r, traj in zip(reply.rewards, trajectories)]

    def _chunks(self, trajectories: Sequence[trajectory_pb2.Trajectory]) -> list[list[trajectory_pb2.Trajectory]]:
        chunks: list[list[trajectory_pb2.Trajectory]] = [[]]
        size = 0
        for traj in trajectories:
            n = traj.ByteSize()
            if chunks[-1] and size + n > self.max_request_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(traj)
            size += n
        return [chunk for chunk in chunks if chunk]

    async def aclose(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


def _checked(breakdown: reward_pb2.RewardBreakdown, traj: trajectory_pb2.Trajectory) -> Scored:
    """The reply's score of `traj`, refused (Internal) unless it is finite and has none or one turn reward per turn."""
    turns = list(breakdown.turn_rewards)
    values = [breakdown.total, *breakdown.components.values(), *turns]
    if turns and len(turns) != len(traj.turns):
        raise Internal(f"{len(turns)} turn rewards for trajectory {traj.trajectory_id!r} of {len(traj.turns)} turns")
    if not all(math.isfinite(v) for v in values):
        raise Internal(f"a non-finite reward for trajectory {traj.trajectory_id!r}")
    return Scored(breakdown.total, dict(breakdown.components), turns)
