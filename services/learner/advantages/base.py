"""Advantage estimators: per-token rewards in, per-token advantages out, plus the masked scans and
group statistics they share."""

from __future__ import annotations

import abc
from dataclasses import KW_ONLY, dataclass

import torch

from services.common.config import AlgorithmConfig


@dataclass(frozen=True, eq=False)
class Turns:
    """Every turn of the batch (N): a row's turns are consecutive, in the order they were played.

    Tensors [N]: row (its batch row), start and end (its model tokens [start, end) in that row; equal for a turn
    without tokens), reward (the env's reward for the turn), invalid (bool: its action did not parse, or the env
    refused it), process (its process reward from the reward service; None: zeros). anchor: N strings, the anchor
    observation of the state the turn acted from ("": unknown)."""

    row: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    reward: torch.Tensor
    invalid: torch.Tensor
    anchor: tuple[str, ...]
    process: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class AdvantageInputs:
    """What every estimator reads, for the whole global batch (group statistics need every member of a group).

    Tensors: token_rewards, response_mask, values [B, T] (position t = token t); group_index [B] ints.
    `values` are the critic's (None without one); `gamma`/`lam` are for the return-based estimators; `turns` is
    given to estimators that set `needs_turns` (None otherwise); `baselines` [B], each row's group baseline score
    (its greedy episode's), to estimators that set `needs_baseline` (None otherwise)."""

    token_rewards: torch.Tensor
    response_mask: torch.Tensor
    group_index: torch.Tensor
    _: KW_ONLY
    values: torch.Tensor | None = None
    gamma: float = 1.0
    lam: float = 1.0
    turns: Turns | None = None
    baselines: torch.Tensor | None = None


class AdvantageEstimator(abc.ABC):
    """Per-token rewards in (`AdvantageInputs`), per-token advantages out.

    Estimators that need a critic set `needs_values`, read `inputs.values` and also give the critic's targets
    through `advantages_and_returns`; estimators that set `needs_baseline` read `inputs.baselines`.
    """

    name: str = "base"
    needs_values: bool = False
    needs_turns: bool = False
    needs_baseline: bool = False

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> AdvantageEstimator:
        return cls()

    @abc.abstractmethod
    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        """Advantages [B, T], zero where response_mask is 0."""

    def advantages_and_returns(self, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, value targets); the targets matter only to estimators with a critic."""
        adv = self.compute(inputs)
        return adv, adv

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the last `compute`, for the step's metrics."""
        return {}


def sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B]: each trajectory's total reward over its model tokens."""
    return (token_rewards * response_mask.to(token_rewards.dtype)).sum(-1)


def group_sums(values: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense group id per row [B], member count per group [G], sum of `values` per group [G])."""
    _, groups = torch.unique(group_index, return_inverse=True)
    n_groups = int(groups.max()) + 1 if groups.numel() else 0
    counts = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, groups, torch.ones_like(values)
    )
    sums = torch.zeros_like(counts).index_add_(0, groups, values)
    return groups, counts, sums


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries (unbiased variance, as verl's masked_whiten)."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


def _compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Moves each row's masked entries to the front, in order: (compacted x, compacted mask, gather order)."""
    order = torch.sort((mask == 0).to(torch.int8), dim=-1, stable=True).indices
    return x.gather(-1, order), mask.gather(-1, order).to(x.dtype), order


def _expand(xc: torch.Tensor, order: torch.Tensor, mask_c: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(xc).scatter_(-1, order, xc * mask_c)


def next_masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: at each masked position, `x` at the row's next masked position (0 after the last one).

    Only the model's tokens are steps of the decision process; prompt and observation tokens in between
    are part of the next state, so "next" skips them."""
    xc, mc, order = _compact(x, mask)
    nxt = torch.nn.functional.pad((xc * mc)[..., 1:], (0, 1))
    return _expand(nxt, order, mc)


def reverse_discounted_sum(x: torch.Tensor, mask: torch.Tensor, factor: float) -> torch.Tensor:
    """[B, T]: y_t = x_t + factor * y_next over each row's masked positions (next as in `next_masked`)."""
    xc, mc, order = _compact(x, mask)
    out = torch.zeros_like(xc)
    running = torch.zeros_like(xc[..., 0])
    for t in range(xc.shape[-1] - 1, -1, -1):
        running = (xc[..., t] + factor * running) * mc[..., t]
        out[..., t] = running
    return _expand(out, order, mc)
