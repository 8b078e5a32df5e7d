"""Policy losses: the learner's logprobs and the step's advantages in, the policy-gradient loss out.

The trainer calls the configured loss once per micro-batch; its value must be the micro-batch's share of
the mini-batch loss, so a loss aggregates with the divisors it is given (`losses.aggregate` with
`PolicyLossInputs.divisors`) and the micro-batches and ranks add up to the full-batch loss and gradient."""

from __future__ import annotations

import abc
from dataclasses import KW_ONLY, dataclass

import torch

from services.common.config import AlgorithmConfig
from services.learner.losses import k3_kl, masked_mean, ppo_kl

POLICY_STATS = ("clip_frac", "clip_frac_lower", "approx_kl", "ppo_kl", "ratio_mean")
"""What every loss reports (detached means over this micro-batch's masked tokens): approx_kl is k3 of the old
against the new policy, ppo_kl verl's mean of log p_old - log p; a loss that does not clip reports 0 for the
clip fractions."""


@dataclass(frozen=True, eq=False)
class PolicyLossInputs:
    """[B, T] tensors of one micro-batch, position t = token t.

    `logprobs` carries the gradient; `old_logprobs` are the learner's own logprobs of the step's starting
    weights; `is_weights` (detached, optional) are the importance weights against the rollout policy
    (`rollout_correction`); `num_tokens`/`num_seqs`/`loss_scale_factor` are the mini-batch's loss divisors
    (None: this batch's own). `response_mask` is 0 on tokens the rollout correction rejected."""

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    _: KW_ONLY
    is_weights: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None
    loss_scale_factor: float | None = None

    @property
    def divisors(self) -> dict[str, float | None]:
        """The keyword arguments of `losses.aggregate` that make micro-batches add up to the mini-batch."""
        return {"num_tokens": self.num_tokens, "num_seqs": self.num_seqs, "loss_scale_factor": self.loss_scale_factor}


class PolicyLoss(abc.ABC):
    """Built once per trainer from the algorithm config; called with one micro-batch at a time."""

    name: str = "base"

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> PolicyLoss:
        return cls()

    @abc.abstractmethod
    def __call__(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(scalar loss, the `POLICY_STATS` as detached scalars)."""


class ClippedRatioLoss(PolicyLoss):
    """A loss that clips its ratio to [1 - clip_ratio_low, 1 + clip_ratio_high] and aggregates by `loss_agg_mode`."""

    def __init__(self, *, clip_low: float = 0.2, clip_high: float = 0.2, agg_mode: str = "token-mean"):
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.agg_mode = agg_mode

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> ClippedRatioLoss:
        return cls(clip_low=config.clip_ratio_low, clip_high=config.clip_ratio_high, agg_mode=config.loss_agg_mode)


def kl_and_ratio_stats(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, ratio: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """approx_kl, ppo_kl and ratio_mean of `POLICY_STATS` (detached), `ratio` being the loss's own ratio."""
    with torch.no_grad():
        return {
            "approx_kl": masked_mean(k3_kl(logprobs, old_logprobs), mask),
            "ppo_kl": ppo_kl(logprobs, old_logprobs, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
