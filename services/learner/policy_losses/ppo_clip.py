"""PPO's clipped surrogate (`losses.policy_loss`): the ratio clipped to [1 - clip_ratio_low,
1 + clip_ratio_high], dual-clip at clip_ratio_c for negative advantages, token losses weighted by the
truncated importance weights, aggregated by `loss_agg_mode`."""

from __future__ import annotations

import torch

from services.common.config import AlgorithmConfig
from services.learner.losses import policy_loss
from services.learner.policy_losses import POLICY_LOSSES
from services.learner.policy_losses.base import PolicyLoss, PolicyLossInputs


@POLICY_LOSSES.register("ppo_clip")
class PPOClip(PolicyLoss):
    name = "ppo_clip"

    def __init__(
        self,
        *,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        clip_ratio_c: float | None = 3.0,
        agg_mode: str = "token-mean",
    ):
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.clip_ratio_c = clip_ratio_c
        self.agg_mode = agg_mode

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> PPOClip:
        return cls(
            clip_low=config.clip_ratio_low,
            clip_high=config.clip_ratio_high,
            clip_ratio_c=config.clip_ratio_c,
            agg_mode=config.loss_agg_mode,
        )

    def __call__(self, inputs: PolicyLossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_loss(
            inputs.logprobs,
            inputs.old_logprobs,
            inputs.advantages,
            inputs.response_mask,
            self.clip_low,
            self.clip_high,
            self.agg_mode,
            clip_ratio_c=self.clip_ratio_c,
            is_weights=inputs.is_weights,
            **inputs.divisors,
        )
