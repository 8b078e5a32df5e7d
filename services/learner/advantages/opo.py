"""OPO (verl's `opo`): each trajectory's score against its group's length-weighted mean score,
b = sum(l_i * s_i) / sum(l_i) with l_i the trajectory's model tokens, on every model token. A group of one
gets 0 (`singleton="zero"`) or its raw score (`"score"`, verl's baseline 0)."""

from __future__ import annotations

import torch

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs, group_sums, sequence_scores


@ADVANTAGES.register("opo")
class OPO(AdvantageEstimator):
    name = "opo"

    def __init__(self, *, singleton: str = "zero"):
        self.singleton = singleton

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> OPO:
        return cls(singleton=config.singleton_group_advantage)

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        scores = sequence_scores(inputs.token_rewards, mask)
        lengths = mask.sum(-1)
        groups, counts, weighted = group_sums(lengths * scores, inputs.group_index)
        total = torch.zeros_like(counts).index_add_(0, groups, lengths)
        # a group whose members have no model tokens has no weight; its advantages are masked out anyway
        baseline = weighted / total.clamp(min=1)
        alone = scores if self.singleton == "score" else torch.zeros_like(scores)
        adv = torch.where(counts[groups] > 1, scores - baseline[groups], alone)
        return adv.unsqueeze(-1) * mask
