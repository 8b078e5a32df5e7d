"""Where a trajectory's reward lands on its model tokens (`RewardConfig.allocation`).

The reward has two parts: each turn's process reward (`Turn.process_reward`, from the per-turn reward components)
and the rest, the outcome. The strategy places the outcome on the whole episode and each process reward on its
turn: `last_token` on the turn's last token, `uniform_positive` spread over the turn's tokens (when positive),
`discounted` spread over the turn and discounted back over the turns before it (reward-to-go). A turn without model
tokens has nowhere to take its process reward: it joins the outcome, so the tokens always carry the whole reward.

Plain Python on purpose: the rollout and reward sides may use it without torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.registry import Registry
from services.common.trajectory import Trajectory, model_segments

Segments = Sequence[tuple[int, int]]
Allocation = Callable[[Sequence[int], Segments, float, float], list[float]]

ALLOCATIONS: Registry[list[float]] = Registry("reward allocation")
REACHES_BACK = {"discounted"}
"""Strategies that place a turn's process reward on the turns before it as well (the others: on that turn only)."""


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
    """Per-token rewards of one trajectory, zeros off the model tokens; they sum to `traj.reward` (up to float
    rounding, and less what `discounted` discounts away)."""
    mask, segments = list(traj.loss_mask), model_segments(traj)
    placed = [(t, t.process_reward) for t in traj.turns if t.process_reward and t.model_tokens]
    outcome = traj.reward - sum(value for _, value in placed)
    out = allocate(name, mask, segments, outcome, gamma)
    for turn, value in placed:
        end = turn.start + turn.model_tokens
        scope = [s for s in segments if s[1] <= end] if name in REACHES_BACK else [(turn.start, end)]
        scope_mask = [0] * len(mask)
        for start, stop in scope:
            scope_mask[start:stop] = [1] * (stop - start)
        for i, v in enumerate(allocate(name, scope_mask, scope, value, gamma)):
            if v:
                out[i] += v
    return out
