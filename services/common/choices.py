"""Config-time checks of plugin choices: a name must be in its registry, and an env's options or a
reward function's params must match what that plugin declares, so a typo fails when the config is
parsed, naming the field, instead of minutes later in a service.

The registries are imported on first check, never at import time (parsing a config loads no torch
or vLLM). Plugins registered outside this package (`--import MODULE` of the envs and reward services)
are known to other processes through `OMRL_PLUGINS`: comma-separated modules imported before a lookup.
"""

from __future__ import annotations

import importlib
import inspect
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import InitErrorDetails, PydanticCustomError

from services.common.registry import Registry

REGISTRIES: dict[str, tuple[str, str]] = {
    "env": ("services.envs.registry", "ENVS"),
    "reward": ("services.reward.registry", "REWARDS"),
    "advantage": ("services.learner.advantages", "ADVANTAGES"),
    "policy_loss": ("services.learner.policy_losses", "POLICY_LOSSES"),
    "weight_push": ("services.learner.weight_push", "PUSHERS"),
    "backend": ("services.rollout.backends.base", "BACKENDS"),
    "action_parser": ("services.rollout.action_parsers", "PARSERS"),
}
"""Plugin kind -> (module, attribute) of its registry."""

_imported_plugins: set[str] = set()


def _import_plugins() -> None:
    for module in filter(None, (m.strip() for m in os.environ.get("OMRL_PLUGINS", "").split(","))):
        if module not in _imported_plugins:
            importlib.import_module(module)
            _imported_plugins.add(module)


def registry(kind: str) -> Registry:
    _import_plugins()
    module, attr = REGISTRIES[kind]
    return getattr(importlib.import_module(module), attr)


def check_choice(kind: str, name: str) -> str:
    names = registry(kind).names()
    if name not in names:
        raise ValueError(f"{name!r} is not one of: {', '.join(names)}")
    return name


@dataclass(frozen=True)
class PluginChoice:
    """Marks a config field as the name of a `kind` plugin (help texts list the registered names)."""

    kind: str


def choice_validator(kind: str) -> Callable[[str], str]:
    def validate(name: str) -> str:
        return check_choice(kind, name)

    return validate


def _located(exc: ValidationError, prefix: tuple, known: list[str], what: str, owner: str) -> ValidationError:
    """The plugin's errors re-rooted at `prefix` (raised in a field validator, pydantic puts the field's
    own path in front): each names the exact key, and an unknown key lists the known ones."""
    details = []
    for error in exc.errors():
        if error["type"] == "extra_forbidden":
            kind = f"unknown_{what}"
            text = f"unknown {what} {error['loc'][-1]!r} of {owner}; known: {', '.join(known) or 'none'}"
        else:
            kind, text = f"invalid_{what}", error["msg"].removeprefix("Value error, ")
        details.append(
            InitErrorDetails(
                type=PydanticCustomError(kind, "{message}", {"message": text}),
                loc=prefix + tuple(error["loc"]),
                input=error["input"],
            )
        )
    return ValidationError.from_exception_data(owner, details)


def check_env_options(env: str, options: dict[str, Any]) -> None:
    """Validates `options` with the env's own `Options` model (the one its `reset` parses them with).
    A process without the env's dependencies (the reward image has no httpx for `agentgym`) cannot run
    it and leaves the check to the env service and to the job API, which has them."""
    try:
        model: type[BaseModel] = registry("env").get(env).Options
    except ImportError:
        return
    try:
        model.model_validate(options)
    except ValidationError as exc:
        raise _located(exc, (), sorted(model.model_fields), "option", f"env {env!r}") from None


def reward_params_model(name: str) -> type[BaseModel]:
    """The params a reward function takes: the keyword arguments of its `__init__` (strict types, as
    the functions check their params by isinstance)."""
    from services.reward.base import RewardFunction
    from services.reward.registry import reward_class

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


def check_reward_params(name: str, params: dict[str, Any]) -> None:
    model = reward_params_model(name)
    try:
        model.model_validate(params)
    except ValidationError as exc:
        raise _located(
            exc, (name, "params"), sorted(model.model_fields), "param", f"reward function {name!r}"
        ) from None
