"""Policy losses: the learner's logprobs and the step's advantages in, the policy-gradient loss out.

The trainer calls the configured loss once per micro-batch; its value must be the micro-batch's share of
the mini-batch loss, so a loss aggregates with the divisors it is given (`losses.aggregate` with
`num_tokens`/`num_seqs`) and the micro-batches and ranks add up to the full-batch loss and gradient."""

from __future__ import annotations

import abc
from dataclasses import KW_ONLY, dataclass

import torch

from services.common.config import AlgorithmConfig

POLICY_STATS = ("clip_frac", "clip_frac_lower", "approx_kl", "ratio_mean")
"""What every loss reports (detached means over this micro-batch's masked tokens); a loss that does not
clip reports 0 for the clip fractions."""


@dataclass(frozen=True, eq=False)
class PolicyLossInputs:
    """[B, T] tensors of one micro-batch, position t = token t.

    `logprobs` carries the gradient; `old_logprobs` are the learner's own logprobs of the step's starting
    weights; `is_weights` (detached, optional) are the truncated importance weights against the rollout
    policy (`algorithm.tis_cap`); `num_tokens`/`num_seqs` are the mini-batch's loss divisors (None: this
    batch's own)."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    _: KW_ONLY
    is_weights: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None


class PolicyLoss(abc.ABC):
    """Built once per trainer from the algorithm config; called with one micro-batch at a time."""

    name: str = "base"

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> PolicyLoss:
        return cls()

    @abc.abstractmethod
    def __call__(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(scalar loss, the `POLICY_STATS` as detached scalars)."""
