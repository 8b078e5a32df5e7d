"""RLOO: each trajectory's score against the mean of the other members of its group; a group of one gets 0
(`singleton="zero"`, TRL) or its raw score (`"score"`, verl)."""

from __future__ import annotations

import torch

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs, group_sums, sequence_scores


@ADVANTAGES.register("rloo")
class RLOO(AdvantageEstimator):
    name = "rloo"

    def __init__(self, *, singleton: str = "zero"):
        self.singleton = singleton

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> RLOO:
        return cls(singleton=config.singleton_group_advantage)

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        scores = sequence_scores(inputs.token_rewards, mask)
        groups, counts, sums = group_sums(scores, inputs.group_index)
        n = counts[groups]
        baseline = (sums[groups] - scores) / (n - 1).clamp(min=1)
        alone = scores if self.singleton == "score" else torch.zeros_like(scores)
        adv = torch.where(n > 1, scores - baseline, alone)
        return adv.unsqueeze(-1) * mask
