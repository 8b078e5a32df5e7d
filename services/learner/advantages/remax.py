"""ReMax (verl's `remax`): the baseline is the score of one greedy (temperature 0) episode of the group's
task, played by the rollout next to the group and marked `baseline` in its record; the trainer drops that
row and gives its score to every member as `AdvantageInputs.baselines`. The advantage of model token t is
its undiscounted return-to-go (the rewards of the row's model tokens from t on) minus the baseline."""

from __future__ import annotations

import torch

from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs, reverse_discounted_sum


@ADVANTAGES.register("remax")
class ReMax(AdvantageEstimator):
    name = "remax"
    needs_baseline = True

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        if inputs.baselines is None:
            raise ValueError("remax needs each row's greedy baseline score (AdvantageInputs.baselines)")
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        returns = reverse_discounted_sum(inputs.token_rewards, mask, 1.0)
        return returns - inputs.baselines.to(returns.dtype).unsqueeze(-1) * mask
