"""RLOO: each trajectory's score against the mean of the other members of its group."""

from __future__ import annotations

import torch

from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs, group_sums, sequence_scores


@ADVANTAGES.register("rloo")
class RLOO(AdvantageEstimator):
    name = "rloo"

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        scores = sequence_scores(inputs.token_rewards, mask)
        groups, counts, sums = group_sums(scores, inputs.group_index)
        n = counts[groups]
        baseline = (sums[groups] - scores) / (n - 1).clamp(min=1)
        adv = torch.where(n > 1, scores - baseline, torch.zeros_like(scores))
        return adv.unsqueeze(-1) * mask
