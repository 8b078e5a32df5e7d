"""GRPO: each trajectory's score against its group (Dr.GRPO without the std division)."""

from __future__ import annotations

import torch

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs, group_sums, sequence_scores


@ADVANTAGES.register("grpo")
class GRPO(AdvantageEstimator):
    name = "grpo"

    def __init__(self, *, norm_adv_by_std: bool = True, eps: float = 1e-6):
        self.norm_adv_by_std = norm_adv_by_std
        self.eps = eps

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> GRPO:
        return cls(norm_adv_by_std=config.norm_adv_by_std)

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        scores = sequence_scores(inputs.token_rewards, mask)
        groups, counts, sums = group_sums(scores, inputs.group_index)
        centred = scores - (sums / counts)[groups]
        if self.norm_adv_by_std:
            sq = torch.zeros_like(counts).index_add_(0, groups, centred * centred)
            std = (sq / (counts - 1).clamp(min=1)).sqrt()
            centred = centred / (std[groups] + self.eps)
        centred = torch.where(counts[groups] > 1, centred, torch.zeros_like(centred))
        return centred.unsqueeze(-1) * mask
