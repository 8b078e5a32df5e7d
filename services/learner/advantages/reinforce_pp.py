"""REINFORCE++: discounted token returns whitened over the batch; the `_baseline` variant subtracts the
group's mean score first (verl's reinforce_plus_plus / reinforce_plus_plus_baseline)."""

from __future__ import annotations

import torch

from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import (
    AdvantageEstimator,
    AdvantageInputs,
    group_sums,
    masked_whiten,
    reverse_discounted_sum,
    sequence_scores,
)


@ADVANTAGES.register("reinforce_plus_plus")
class ReinforcePlusPlus(AdvantageEstimator):
    """Return of token t: its reward plus gamma times the return of the next model token."""

    name = "reinforce_plus_plus"

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        return masked_whiten(reverse_discounted_sum(inputs.token_rewards, mask, inputs.gamma), mask)


@ADVANTAGES.register("reinforce_plus_plus_baseline")
class ReinforcePlusPlusBaseline(AdvantageEstimator):
    """Score minus its group's mean (0 baseline for a group of one) on every model token, then whitened."""

    name = "reinforce_plus_plus_baseline"

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        scores = sequence_scores(inputs.token_rewards, mask)
        groups, counts, sums = group_sums(scores, inputs.group_index)
        mean = torch.where(counts > 1, sums / counts, torch.zeros_like(sums))
        return masked_whiten((scores - mean[groups]).unsqueeze(-1) * mask, mask)
