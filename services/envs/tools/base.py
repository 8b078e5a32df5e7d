"""Tools an agent calls during an episode, served by the env service.

A toolset is one configured instance of a registered type (`python`, `calculator`, `search`, `editor`,
`mcp`): it declares its tools' JSON schemas (`specs`) and runs calls (`call`). The env service starts each
configured toolset once and shares it across episodes; what belongs to one episode reaches a call through
its `ToolContext` (the episode's workspace folder, the time the call may take). A call that cannot be
served raises `ToolError`: its message goes back to the model as an error observation, counted, and the
episode goes on."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from services.common.registry import Registry


class ToolOptions(BaseModel):
    """A toolset's settings from the config; subclasses add fields. Unknown keys are refused."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object."""

    def as_function(self) -> dict[str, Any]:
        """The OpenAI function shape chat templates take (`apply_chat_template(..., tools=[...])`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolOutput:
    content: str
    error: bool = False
    """True where the tool ran and reports a failure the model should read (a non-zero exit, say)."""


class ToolError(Exception):
    """A call the tool refused or could not finish; the message is what the model reads."""

    def __init__(self, message: str, kind: str = "failed"):
        """`kind` labels the error counter: failed, timeout, limit, refused, unavailable."""
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class ToolContext:
    episode_id: str
    workspace: Path
    """The episode's own folder: a call may read and write only here (the service creates and removes it)."""
    time_left: float
    """Seconds the call may take before its caller gives up."""


class Toolset(abc.ABC):
    """One configured instance, shared by every episode of the env service. `call` may run concurrently
    for many episodes and for several calls of one turn."""

    type: ClassVar[str] = "base"
    Options: ClassVar[type[ToolOptions]] = ToolOptions

    def __init__(self, options: ToolOptions):
        self.options = options

    capacity: int | None = None
    """Calls it runs at once (the rest wait for a slot); None: no limit. A call's deadline grows with the calls
    queued ahead of it (services.envs.tool_host), as the env-call deadlines do."""

    @classmethod
    def capacity_of(cls, options: ToolOptions) -> int | None:
        """`capacity` of an instance with these options, known before one is built (the run's deadlines)."""
        return None

    async def start(self) -> None:
        """Connects or builds what the toolset needs (an MCP session, a search index); called once before
        the first `specs` and `call`."""

    @abc.abstractmethod
    def specs(self) -> list[ToolSpec]:
        """The tools this instance offers (names unique across an episode's toolsets)."""

    @abc.abstractmethod
    async def call(self, name: str, arguments: dict[str, Any], ctx: ToolContext) -> ToolOutput:
        """Runs tool `name` (one of `specs`) with arguments already checked against its schema."""

    async def aclose(self) -> None:
        """Releases what `start` took."""


def _options(name: str) -> type[ToolOptions]:
    return TOOLSETS.get(name).Options


TOOLSETS: Registry[Toolset] = Registry("toolset", choice="toolset", options=_options)
