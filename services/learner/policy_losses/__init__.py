"""Policy losses by name (`AlgorithmConfig.policy_loss`); one module per loss.

A new loss is a module here with a `PolicyLoss` subclass under `@POLICY_LOSSES.register("name")`, and one
`register_lazy` line below so the config knows the name without importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.registry import Registry

if TYPE_CHECKING:
    from services.common.config import AlgorithmConfig
    from services.learner.policy_losses.base import PolicyLoss

POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", choice="policy_loss")
POLICY_LOSSES.register_lazy("ppo_clip", "services.learner.policy_losses.ppo_clip")
POLICY_LOSSES.register_lazy("gspo", "services.learner.policy_losses.gspo")
POLICY_LOSSES.register_lazy("cispo", "services.learner.policy_losses.cispo")


def build_policy_loss(config: AlgorithmConfig) -> PolicyLoss:
    return POLICY_LOSSES.get(config.policy_loss).from_config(config)
