"""GAE with a learned critic (PPO). Steps are the model's tokens; prompt and observation tokens in between
belong to the next state, so each token's successor is the row's next model token."""

from __future__ import annotations

import torch

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import (
    AdvantageEstimator,
    AdvantageInputs,
    masked_whiten,
    next_masked,
    reverse_discounted_sum,
)


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw (unwhitened) advantages and the returns (advantages + values) that the critic regresses on.

    delta_t = r_t + gamma * V_next - V_t, with V_next = 0 after the last model token;
    A_t = delta_t + gamma * lam * A_next."""
    mask = response_mask.to(values.dtype)
    values = values * mask
    deltas = (token_rewards + gamma * next_masked(values, mask) - values) * mask
    adv = reverse_discounted_sum(deltas, mask, gamma * lam)
    return adv, (adv + values) * mask


@ADVANTAGES.register("gae")
class GAE(AdvantageEstimator):
    name = "gae"
    needs_values = True

    def __init__(self, *, whiten: bool = True):
        self.whiten = whiten

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> GAE:
        return cls()

    def advantages_and_returns(self, inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs.values is None:
            raise ValueError("GAE needs the critic's values")
        adv, returns = gae(inputs.token_rewards, inputs.values, inputs.response_mask, inputs.gamma, inputs.lam)
        return (masked_whiten(adv, inputs.response_mask) if self.whiten else adv), returns

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        return self.advantages_and_returns(inputs)[0]
