"""Every plugin registry of the services, by the plugin kind a config field names (`_plugin(kind)` in
`services.common.config`): the full set, for what checks or lists them all. Every command line imports it
before it parses a config (each service's `__main__`, the launcher, the CLI; the job API through
`services.jobs.spec`), so every plugin field of a run config is checked when it is parsed, in every process
(`services.common.choices`). It sits above the services whose registries it imports, below the job API and the
front ends; a service's `__main__` is its process's top and the one exception (the layers in pyproject.toml,
[tool.importlinter]).

Importing a registry declares its kind (`Registry(choice=...)`); `REGISTRIES` lists them all."""

from __future__ import annotations

from pydantic import BaseModel

from services.common import choices
from services.common.registry import Registry
from services.engines.base import BACKENDS
from services.envs.registry import ENVS
from services.envs.tools import TOOLSETS
from services.learner.advantages import ADVANTAGES
from services.learner.policy_losses import POLICY_LOSSES
from services.reward.registry import REWARDS
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loops import AGENT_LOOPS
from services.rollout.tool_parsers import TOOL_PARSERS
from services.weightsync import PUSHERS

REGISTRIES: dict[str, Registry] = {
    "env": ENVS,
    "reward": REWARDS,
    "advantage": ADVANTAGES,
    "policy_loss": POLICY_LOSSES,
    "weight_push": PUSHERS,
    "backend": BACKENDS,
    "action_parser": PARSERS,
    "agent_loop": AGENT_LOOPS,
    "tool_parser": TOOL_PARSERS,
    "toolset": TOOLSETS,
}
"""Plugin kind -> its registry."""


def registry(kind: str) -> Registry:
    """The registry of `kind`, with the plugins of the `OMRL_PLUGINS` modules registered."""
    choices.import_plugins()
    return REGISTRIES[kind]


def names(kind: str) -> list[str]:
    return registry(kind).names()


def options_model(kind: str, name: str) -> type[BaseModel]:
    """The model a plugin's options are checked with: an env's `Options`, a reward function's params (from
    its `__init__`). KeyError for an unknown name, ImportError where the plugin needs a package this install
    lacks."""
    return registry(kind).options(name)
