"""Config-time checks of plugin choices: a name must be in its registry, and an env's options, a reward
function's params or a backend's engine arguments must match what that plugin declares, so a typo fails
when the config is parsed, naming the field, instead of minutes later in a service.

The registries are the services' own: each declares the plugin kind it serves when it is created
(`services.common.registry.Registry(choice=...)`), with its plugins' option schemas, and this module
imports none of them. A process checks the kinds whose registries it has imported: every command line
(each service's `__main__`, the launcher, the CLI, the job API) imports them all, `services.plugins`,
before it parses a config; a kind whose registry a process has not imported is not checked there.
Registries import no torch or vLLM (their plugins are lazy entries). Plugins registered outside this
package (`--import MODULE` of the envs and reward services) are known to other processes through
`OMRL_PLUGINS`: comma-separated modules imported before a lookup.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from services.common.registry import Registry, chosen_by

_imported_plugins: set[str] = set()


def import_plugins() -> None:
    """Imports the `OMRL_PLUGINS` modules (once each): their plugins register."""
    for module in filter(None, (m.strip() for m in os.environ.get("OMRL_PLUGINS", "").split(","))):
        if module not in _imported_plugins:
            importlib.import_module(module)
            _imported_plugins.add(module)


def registry(kind: str) -> Registry | None:
    """The registry of plugin kind `kind`; None where this process has not imported it."""
    import_plugins()
    return chosen_by(kind)


def check_choice(kind: str, name: str) -> str:
    found = registry(kind)
    if found is None:  # a process that has not imported the kind's registry (see the module docstring)
        return name
    names = found.names()
    if name not in names:
        raise ValueError(f"{name!r} is not one of: {', '.join(names)}")
    return name


def is_choice(kind: str, name: str) -> bool:
    """`name` is a registered `kind` plugin (False where the kind's registry is not loaded)."""
    found = registry(kind)
    return found is not None and name in found.names()


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
    """Validates `options` with the env's own `Options` model (the one its `reset` parses them with)."""
    _check_options("env", env, options)


def check_toolset_options(kind: str, options: dict[str, Any]) -> None:
    """Validates a toolset's `options` with its type's `Options` model."""
    _check_options("toolset", kind, options)


def _check_options(kind: str, name: str, options: dict[str, Any]) -> None:
    """`options` checked with plugin `name`'s options model. A process without the plugin's dependencies (the
    reward image has no httpx for `agentgym`) cannot run it and leaves the check to the service that runs it and
    to the job API, which have them."""
    plugins = registry(kind)
    try:
        model: type[BaseModel] | None = plugins.options(name) if plugins is not None else None
    except ImportError:
        return
    if model is None:
        return
    try:
        model.model_validate(options)
    except ValidationError as exc:
        raise _located(exc, (), sorted(model.model_fields), "option", f"{kind} {name!r}") from None


def check_reward_function(name: str, function: str, named_by_type: bool) -> None:
    """The component `name` runs a registered reward function; else a ValidationError at its key (or its `type`)."""
    try:
        check_choice("reward", function)
    except ValueError as exc:
        where = (name, "type") if named_by_type else (name, "[key]")
        error = PydanticCustomError("value_error", "{message}", {"message": str(exc)})  # as other plugin names
        raise ValidationError.from_exception_data(
            "reward components", [InitErrorDetails(type=error, loc=where, input=function)]
        ) from None


def check_reward_params(name: str, params: dict[str, Any], function: str | None = None) -> None:
    """`params` of the component `name`, which runs the reward function `function` (default: `name`)."""
    function = function or name
    rewards = registry("reward")
    model: type[BaseModel] | None = rewards.options(function) if rewards is not None else None
    if model is None:
        return
    try:
        model.model_validate(params)
    except ValidationError as exc:
        raise _located(
            exc, (name, "params"), sorted(model.model_fields), "param", f"reward function {function!r}"
        ) from None


def reward_deadline(name: str, params: dict[str, Any]) -> float | None:
    """The `timeout_s` a reward function's params give it (their own or its default), None where it has none or its
    params do not validate (check_reward_params reports those)."""
    rewards = registry("reward")
    model: type[BaseModel] | None = rewards.options(name) if rewards is not None else None
    if model is None or "timeout_s" not in model.model_fields:
        return None
    try:
        return float(model.model_validate(params).timeout_s)
    except ValidationError:
        return None


def check_engine_args(backend: str, engine_args: dict[str, Any]) -> None:
    """`rollout.engine_args` checked by what the backend declares (the vLLM backend: its engine's fields);
    a ValidationError located at each bad key."""
    backends = registry("backend")
    check = backends.options(backend) if backends is not None else None
    if check is not None:
        check(engine_args)
