"""Where a trajectory's scalar reward lands on its model tokens (`RewardConfig.allocation`).

Plain Python on purpose: the rollout and reward sides may use it without torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.registry import Registry
from services.common.trajectory import Trajectory, model_segments

Segments = Sequence[tuple[int, int]]
Allocation = Callable[[Sequence[int], Segments, float, float], list[float]]

ALLOCATIONS: Registry[list[float]] = Registry("reward allocation")


def _last_model_token(loss_mask: Sequence[int]) -> int:
    for i in range(len(loss_mask) - 1, -1, -1):
        if loss_mask[i]:
            return i
    return -1


@ALLOCATIONS.register("last_token")
def last_token(loss_mask: Sequence[int], segments: Segments, reward: float, gamma: float) -> list[float]:
    out = [0.0] * len(loss_mask)
    last = _last_model_token(loss_mask)
    if last >= 0:
        out[last] = float(reward)
    return out


@ALLOCATIONS.register("uniform_positive")
def uniform_positive(loss_mask: Sequence[int], segments: Segments, reward: float, gamma: float) -> list[float]:
    """A positive reward spread evenly over every model token; zero or negative on the last one only."""
    n = sum(1 for m in loss_mask if m)
    if reward <= 0 or n == 0:
        return last_token(loss_mask, segments, reward, gamma)
    share = float(reward) / n
    return [share if m else 0.0 for m in loss_mask]


@ALLOCATIONS.register("discounted")
def discounted(loss_mask: Sequence[int], segments: Segments, reward: float, gamma: float) -> list[float]:
    """Latest turn first: each turn gets the current reward spread over its tokens, then the reward is
    discounted by gamma per token of that turn."""
    out = [0.0] * len(loss_mask)
    current = float(reward)
    for start, end in reversed(segments):
        length = end - start
        if length <= 0:
            continue
        share = current / length
        for i in range(start, end):
            out[i] = share
        current *= gamma**length
    return out


def allocate(name: str, loss_mask: Sequence[int], segments: Segments, reward: float, gamma: float = 1.0) -> list[float]:
    return ALLOCATIONS.get(name)(loss_mask, segments, reward, gamma)


def trajectory_token_rewards(traj: Trajectory, name: str, gamma: float = 1.0) -> list[float]:
    """Per-token rewards of one trajectory, zeros off the model tokens."""
    return allocate(name, list(traj.loss_mask), model_segments(traj), traj.reward, gamma)
