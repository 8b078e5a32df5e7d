"""The reward-function table.

Adding a reward function is one module plus one line:
  1. `services/reward/my_reward.py`: `class MyReward(RewardFunction)` with `name = "my_reward"`,
     `__call__(traj) -> float` and, if it takes params, an `__init__` with keyword arguments.
  2. Here: `_builtin("my_reward", "services.reward.my_reward:MyReward")`.
Then name it under `reward.components` in the config. Code outside this package registers a class
directly: `REWARDS.register("name")(MyReward)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from services.common.registry import Registry
from services.reward.base import RewardFunction

REWARDS: Registry[RewardFunction] = Registry("reward function")
_BUILTINS: dict[Callable[..., RewardFunction], str] = {}
"""Factory of a builtin -> the `module:Class` it builds."""


def _builtin(name: str, target: str) -> None:
    """Registers `module:Class`, imported on first use."""
    module, _, attr = target.partition(":")

    def create(**params: Any) -> RewardFunction:
        return getattr(importlib.import_module(module), attr)(**params)

    _BUILTINS[create] = target
    REWARDS.register(name)(create)


def reward_class(name: str) -> Callable[..., RewardFunction]:
    """What `REWARDS.create(name, **params)` calls in the end: the class (or factory) whose signature
    declares the params."""
    factory = REWARDS.get(name)
    if factory not in _BUILTINS:
        return factory
    module, _, attr = _BUILTINS[factory].partition(":")
    return getattr(importlib.import_module(module), attr)


_builtin("goal", "services.reward.goal:GoalReward")
_builtin("length_penalty", "services.reward.length_penalty:LengthPenalty")
_builtin("format", "services.reward.format_reward:FormatReward")
_builtin("env_return", "services.reward.env_return:EnvReturn")
