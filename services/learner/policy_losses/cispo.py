"""CISPO (MiniMax-M1, Chen et al. 2025; verl's `cispo` loss): the token's importance ratio clipped to
[1 - clip_ratio_low, 1 + clip_ratio_high] and detached is a weight on the REINFORCE term,
l_t = -sg[clip(r_t)] * A_t * log p_t, so every token keeps its gradient (PPO's clip zeroes it). MiniMax-M1
bounds the ratio from above only: `clip_ratio_low: 1` (lower bound 0). Weighted by the rollout-correction
weights, aggregated by `loss_agg_mode`."""

from __future__ import annotations

import torch

from services.learner.losses import aggregate, masked_mean
from services.learner.policy_losses import POLICY_LOSSES
from services.learner.policy_losses.base import ClippedRatioLoss, PolicyLossInputs, kl_and_ratio_stats


@POLICY_LOSSES.register("cispo")
class CISPO(ClippedRatioLoss):
    name = "cispo"

    def __call__(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        lp, advantages, mask = inputs.logprobs, inputs.advantages, inputs.response_mask
        ratio = torch.exp((lp - inputs.old_logprobs).clamp(-20.0, 20.0)).detach()
        low, high = 1.0 - self.clip_low, 1.0 + self.clip_high
        token_loss = -ratio.clamp(low, high) * advantages * lp
        if inputs.is_weights is not None:
            token_loss = token_loss * inputs.is_weights
        loss = aggregate(token_loss, mask, self.agg_mode, **inputs.divisors)
        with torch.no_grad():
            stats = {
                "clip_frac": masked_mean(((ratio > high) | (ratio < low)).to(ratio.dtype), mask),
                "clip_frac_lower": torch.zeros((), dtype=ratio.dtype, device=ratio.device),
                **kl_and_ratio_stats(lp, inputs.old_logprobs, ratio, mask),
            }
        return loss, stats
