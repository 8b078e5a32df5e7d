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
import inspect
import typing
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from services.common.registry import Registry
from services.reward.base import RewardFunction


def params_model(name: str) -> type[BaseModel]:
    """The params a reward function takes: the keyword arguments of its `__init__` (strict types, as
    the functions check their params by isinstance). Its options schema in REWARDS."""
    target = reward_class(name)
    init = target.__init__ if inspect.isclass(target) else target
    fields: dict[str, Any] = {}
    if init is not RewardFunction.__init__:  # the base takes **params only to reject them
        try:
            hints = typing.get_type_hints(init, include_extras=True)  # Annotated markers (services.common.trust)
        except (NameError, TypeError):  # an annotation this process cannot resolve: check names only
            hints = {}
        params = list(inspect.signature(init).parameters.values())
        for param in params[1:] if inspect.isclass(target) else params:
            if param.kind is param.VAR_KEYWORD:
                return create_model(f"{name}_params", __config__=ConfigDict(extra="allow"))
            if param.kind in (param.VAR_POSITIONAL, param.POSITIONAL_ONLY):
                continue
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (hints.get(param.name, Any), default)
    return create_model(f"{name}_params", __config__=ConfigDict(extra="forbid", strict=True), **fields)


REWARDS: Registry[RewardFunction] = Registry("reward function", choice="reward", options=params_model)
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
_builtin("overlong_penalty", "services.reward.overlong_penalty:OverlongPenalty")
_builtin("format", "services.reward.format_reward:FormatReward")
_builtin("env_return", "services.reward.env_return:EnvReturn")
_builtin("invalid_tool_calls", "services.reward.invalid_tool_calls:InvalidToolCalls")
# a rule per turn (a process reward: services.reward.base.TurnRewardFunction)
_builtin("hinted_action", "services.reward.hinted_action:HintedAction")
# rule scorers against the task dataset's reference answers (services.reward.reference_scorer)
_builtin("exact_match", "services.reward.text_match:ExactMatch")
_builtin("token_f1", "services.reward.text_match:TokenF1")
_builtin("bleu", "services.reward.sacrebleu_scores:Bleu")
_builtin("chrf", "services.reward.sacrebleu_scores:Chrf")
_builtin("math_equiv", "services.reward.math_equiv:MathEquiv")
# a sequence-classification model's score, batched across concurrent Score calls (services.reward.reward_model)
_builtin("reward_model", "services.reward.reward_model:RewardModel")
# a generative model's verdict on a rubric question, served by a vLLM engine of its own (services.reward.judge)
_builtin("llm_judge", "services.reward.judge:LlmJudge")
# the totals of other reward services (their own pods: a reward model, a judge) over gRPC (services.reward.remote)
_builtin("remote", "services.reward.remote:RemoteReward")
