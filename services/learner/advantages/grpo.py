"""GRPO: each trajectory's score against its group (Dr.GRPO without the std division). A group of one has no
baseline: its advantage is 0 (`singleton="zero"`, TRL), or its raw score as verl gives it (`"score"`: verl's
mean 0 and std 1, so score / (1 + eps) with the std division)."""

from __future__ import annotations

import torch

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs, group_sums, sequence_scores


@ADVANTAGES.register("grpo")
class GRPO(AdvantageEstimator):
    name = "grpo"

    def __init__(self, *, norm_adv_by_std: bool = True, eps: float = 1e-6, singleton: str = "zero"):
        self.norm_adv_by_std = norm_adv_by_std
        self.eps = eps
        self.singleton = singleton

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> GRPO:
        return cls(norm_adv_by_std=config.norm_adv_by_std, singleton=config.singleton_group_advantage)

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        scores = sequence_scores(inputs.token_rewards, mask)
        groups, counts, sums = group_sums(scores, inputs.group_index)
        centred = scores - (sums / counts)[groups]
        if self.norm_adv_by_std:
            sq = torch.zeros_like(counts).index_add_(0, groups, centred * centred)
            std = (sq / (counts - 1).clamp(min=1)).sqrt()
            centred = centred / (std[groups] + self.eps)
        alone = scores / (1.0 + self.eps) if self.norm_adv_by_std else scores
        alone = alone if self.singleton == "score" else torch.zeros_like(scores)
        centred = torch.where(counts[groups] > 1, centred, alone)
        return centred.unsqueeze(-1) * mask
