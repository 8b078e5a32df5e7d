"""The reward-function interface: one finished trajectory in, one number out."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # configs name reward functions and are parsed where no generated code is needed
    from services.common.protos import trajectory_pb2


class RewardFunction(abc.ABC):
    """Built as `cls(**params)` from the config's `params`; a bad param must raise TypeError or
    ValueError there, not at scoring time. `__call__` is pure and may run in any thread."""

    name: ClassVar[str] = "base"

    def __init__(self, **params: Any):
        if params:
            raise TypeError(f"{self.name} takes no params, got {sorted(params)}")

    @abc.abstractmethod
    def __call__(self, traj: trajectory_pb2.Trajectory) -> float: ...

    def score_batch(self, trajs: Sequence[trajectory_pb2.Trajectory]) -> list[float]:
        """The scores of several trajectories, in order; a model-backed function runs them together."""
        return [self(traj) for traj in trajs]
