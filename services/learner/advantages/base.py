"""Advantage estimators: per-token rewards in, per-token advantages out."""
from __future__ import annotations

import abc
from typing import Optional

import torch

from services.common.config import AlgorithmConfig


class AdvantageEstimator(abc.ABC):
    """`compute` sees the whole global batch (group statistics need every member of a group).

    Tensors: token_rewards, response_mask, values [B, T] (position t = token t); group_index [B] ints.
    Estimators that need a critic set `needs_values` and read `values`; `gamma`/`lam` are for GAE-style ones.
    """

    name: str = "base"
    needs_values: bool = False

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> "AdvantageEstimator":
        return cls()

    @abc.abstractmethod
    def compute(self, token_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor, *,
                values: Optional[torch.Tensor] = None, gamma: float = 1.0, lam: float = 1.0) -> torch.Tensor:
        """Advantages [B, T], zero where response_mask is 0."""
