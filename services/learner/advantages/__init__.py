"""Advantage estimators by name (`AlgorithmConfig.advantage`); one module per estimator."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.common.registry import Registry

if TYPE_CHECKING:
    from services.common.config import AlgorithmConfig
    from services.learner.advantages.base import AdvantageEstimator

ADVANTAGES: Registry[AdvantageEstimator] = Registry("advantage estimator", choice="advantage")
ADVANTAGES.register_lazy("grpo", "services.learner.advantages.grpo")
ADVANTAGES.register_lazy("rloo", "services.learner.advantages.rloo")
ADVANTAGES.register_lazy("gae", "services.learner.advantages.gae")
ADVANTAGES.register_lazy("reinforce_plus_plus", "services.learner.advantages.reinforce_pp")
ADVANTAGES.register_lazy("reinforce_plus_plus_baseline", "services.learner.advantages.reinforce_pp")
ADVANTAGES.register_lazy("gigpo", "services.learner.advantages.gigpo")
ADVANTAGES.register_lazy("opo", "services.learner.advantages.opo")
ADVANTAGES.register_lazy("remax", "services.learner.advantages.remax")


def build_estimator(config: AlgorithmConfig) -> AdvantageEstimator:
    return ADVANTAGES.get(config.advantage).from_config(config)
