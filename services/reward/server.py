"""The gRPC shell around RewardService."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.common.protos import reward_pb2, reward_pb2_grpc
from services.reward.service import RewardService


class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, service: RewardService):
        self.service = service

    async def Score(self, request: reward_pb2.ScoreRequest, context) -> reward_pb2.ScoreResponse:
        scores = await self.service.score(request.trajectories)
        return reward_pb2.ScoreResponse(
            rewards=[
                reward_pb2.RewardBreakdown(
                    trajectory_id=traj.trajectory_id, total=total, components=parts, turn_rewards=turns
                )
                for traj, (total, parts, turns) in zip(request.trajectories, scores)
            ]
        )


def add_reward_service(service: RewardService) -> Callable[[grpc.aio.Server], None]:
    return lambda server: reward_pb2_grpc.add_RewardServiceServicer_to_server(RewardServicer(service), server)
