"""The environment table. To add an env: write a module with a `TextEnv` subclass decorated with
`@register_env("<name>")`, and add one `ENVS.register_lazy("<name>", "<module>")` line below so the
service finds it without importing every env up front."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from services.common.registry import Registry
from services.envs.base import TextEnv

if TYPE_CHECKING:
    from services.common.config import EnvConfig

E = TypeVar("E", bound=type[TextEnv])


def _options(name: str) -> type:
    """An env's options schema: its `Options` model (the one `reset` parses them with)."""
    return ENVS.get(name).Options


ENVS: Registry[TextEnv] = Registry("environment", choice="env", options=_options)


def preflight(env: EnvConfig) -> str | None:
    """The configured env's check of its backends before a run starts (`TextEnv.preflight`)."""
    return ENVS.get(env.name).preflight(dict(env.options))


def register_env(name: str) -> Callable[[E], E]:
    def decorate(cls: E) -> E:
        cls.name = name
        return ENVS.register(name)(cls)

    return decorate


ENVS.register_lazy("corridor", "services.envs.builtin.corridor")
ENVS.register_lazy("guess_number", "services.envs.builtin.guess_number")
ENVS.register_lazy("maze", "services.envs.builtin.maze")
ENVS.register_lazy("wordle", "services.envs.builtin.wordle")
ENVS.register_lazy("crafting", "services.envs.builtin.crafting")
ENVS.register_lazy("reasoning", "services.envs.builtin.reasoning")
ENVS.register_lazy("babyai", "services.envs.builtin.babyai")
ENVS.register_lazy("tool_arith", "services.envs.builtin.tool_arith")
ENVS.register_lazy("tool_lookup", "services.envs.builtin.tool_lookup")
ENVS.register_lazy("tool_fix", "services.envs.builtin.tool_fix")
ENVS.register_lazy("tool_chain", "services.envs.builtin.tool_chain")
ENVS.register_lazy("agentgym", "services.envs.agentgym.env")
