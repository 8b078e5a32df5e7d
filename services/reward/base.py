"""The reward-function interface: one finished trajectory in, one number out; or, for a process reward, one number
per turn."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # configs name reward functions and are parsed where no generated code is needed
    from services.common.protos import trajectory_pb2


class RewardFunction(abc.ABC):
    """Built as `cls(**params)` from the config's `params`; a bad param must raise TypeError or
    ValueError there, not at scoring time. `__call__` is pure and may run in any thread.

    A process reward sets `per_turn` (a class or an instance attribute: a model may score either way) and implements
    `score_turns`: one score per turn of the trajectory (`traj.turns`), which the learner places on that turn's
    tokens. Its episode score (`__call__`) is the sum of its turn scores."""

    name: ClassVar[str] = "base"
    per_turn: bool = False

    def __init__(self, **params: Any):
        if params:
            raise TypeError(f"{self.name} takes no params, got {sorted(params)}")

    @abc.abstractmethod
    def __call__(self, traj: trajectory_pb2.Trajectory) -> float: ...

    def score_batch(self, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[float]:
        """The scores of several trajectories, in order; a model-backed function runs them together."""
        return [self(traj) for traj in trajs]

    def score_turns(self, traj: trajectory_pb2.Trajectory) -> list[float]:
        """A process reward's score of each of `traj.turns`, in order."""
        raise NotImplementedError(f"{self.name} scores whole episodes, not turns")

    def score_turns_batch(self, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[list[float]]:
        """`score_turns` of several trajectories; a model-backed function runs all their turns together."""
        return [self.score_turns(traj) for traj in trajs]


class TurnRewardFunction(RewardFunction):
    """A process reward only: implement `score_turns`."""

    per_turn = True

    def __call__(self, traj: trajectory_pb2.Trajectory) -> float:
        return float(sum(self.score_turns(traj)))

    @abc.abstractmethod
    def score_turns(self, traj: trajectory_pb2.Trajectory) -> list[float]: ...
