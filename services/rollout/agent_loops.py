"""The agent loops (`rollout.agent_loop`): how an episode turns model replies into environment calls. `text`
(services.rollout.agent_loop.AgentLoop): each reply's action goes to the env's step. `tools`
(services.rollout.tool_loop.ToolCallingLoop): the model sees the episode's tools through its chat template,
its tool calls run on the env service, and a reply without a call is its answer to the env. Add one with a
module that subclasses AgentLoop (same constructor) and a `register_lazy` line here."""

from __future__ import annotations

from typing import Any

from services.common.registry import Registry

AGENT_LOOPS: Registry[Any] = Registry("agent loop", choice="agent_loop")
AGENT_LOOPS.register_lazy("text", "services.rollout.agent_loop")
AGENT_LOOPS.register_lazy("tools", "services.rollout.tool_loop")
