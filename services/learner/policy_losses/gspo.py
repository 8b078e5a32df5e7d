"""GSPO (Zheng et al. 2025; verl's `gspo` loss): PPO's clipped surrogate on a sequence-level ratio
s_i = exp(mean of log p - log p_old over sequence i's model tokens), clipped as a whole to
[1 - clip_ratio_low, 1 + clip_ratio_high], with the gradient through each token (the paper's GSPO-token:
s_i,t = sg[s_i] * p_t / sg[p_t], so d s_i,t / d log p_t = s_i). No dual-clip; token losses weighted by the
rollout-correction weights, aggregated by `loss_agg_mode` (the paper's is seq-mean-token-mean, verl's
default token-mean)."""

from __future__ import annotations

import torch

from services.learner.losses import aggregate, masked_mean
from services.learner.policy_losses import POLICY_LOSSES
from services.learner.policy_losses.base import ClippedRatioLoss, PolicyLossInputs, kl_and_ratio_stats


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the mean of log p - log p_old over each row's masked tokens (0 for a row without any)."""
    m = mask.to(logprobs.dtype)
    return ((logprobs - old_logprobs) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)


def token_sequence_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: s_i at every token of row i, differentiable through that token's own logprob only.

    The log is capped at 10 as verl caps it (a larger ratio is clipped anyway for A > 0)."""
    seq = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)
    # the detached terms are added last: log p - sg[log p] is exactly 0, so the value is s_i to the bit
    return torch.exp((logprobs - logprobs.detach() + seq).clamp(max=10.0))


@POLICY_LOSSES.register("gspo")
class GSPO(ClippedRatioLoss):
    name = "gspo"

    def __call__(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp, advantages, mask = inputs.logprobs, inputs.advantages, inputs.response_mask
        ratio = token_sequence_ratio(lp, inputs.old_logprobs, mask)
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        token_loss = torch.maximum(unclipped, clipped)
        if inputs.is_weights is not None:
            token_loss = token_loss * inputs.is_weights
        loss = aggregate(token_loss, mask, self.agg_mode, **inputs.divisors)
        with torch.no_grad():
            stats = {
                "clip_frac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
                "clip_frac_lower": torch.zeros((), dtype=ratio.dtype, device=ratio.device),
                **kl_and_ratio_stats(lp, inputs.old_logprobs, ratio, mask),
            }
        return loss, stats
