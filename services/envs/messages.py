"""What the env service hands back, and its wire form (both clients return these, never protos)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format, struct_pb2

from services.common.errors import Internal
from services.common.protos import envs_pb2


@dataclass
class EnvInfo:
    name: str
    description: str
    max_turns: int

    def to_proto(self) -> envs_pb2.EnvInfo:
        return envs_pb2.EnvInfo(name=self.name, description=self.description, max_turns=self.max_turns)

    @classmethod
    def from_proto(cls, msg: envs_pb2.EnvInfo) -> EnvInfo:
        return cls(msg.name, msg.description, msg.max_turns)


@dataclass
class EpisodeState:
    episode_id: str
    observation: str
    reward: float = 0.0
    done: bool = False
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    anchor: str = ""
    """The observation without history that names the state (`TextEnv.anchor_observation`)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    """The episode's tools as function schemas (Create and Reset only): what the chat template is given."""

    def to_proto(self) -> envs_pb2.EpisodeState:
        return envs_pb2.EpisodeState(
            episode_id=self.episode_id,
            observation=self.observation,
            reward=self.reward,
            done=self.done,
            success=self.success,
            info=to_struct(self.info),
            anchor=self.anchor,
            tools_json=json.dumps(self.tools) if self.tools else "",
        )

    @classmethod
    def from_proto(cls, msg: envs_pb2.EpisodeState) -> EpisodeState:
        """A server that predates anchors sends none: its observation is the anchor then."""
        anchor = msg.anchor or msg.observation
        try:
            tools = json.loads(msg.tools_json) if msg.tools_json else []
        except (ValueError, RecursionError):
            tools = None
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise Internal(f"episode {msg.episode_id}: tools_json is not a JSON list of function schemas")
        return cls(
            msg.episode_id, msg.observation, msg.reward, msg.done, msg.success, from_struct(msg.info), anchor, tools
        )


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments_json: str
    """The arguments object as the model wrote it (the service parses and checks it)."""

    def to_proto(self) -> envs_pb2.ToolCall:
        return envs_pb2.ToolCall(id=self.id, name=self.name, arguments_json=self.arguments_json)

    @classmethod
    def from_proto(cls, msg: envs_pb2.ToolCall) -> ToolCall:
        return cls(msg.id, msg.name, msg.arguments_json)


MODEL_MISTAKES = frozenset({"invalid", "unknown", "unparsed", "over_limit"})
"""Tool-result kinds that are the model's mistake (a turn's `invalid_tool_calls`): from the env service, arguments
that fail the schema and unknown tools; from the tool-calling loop, calls that did not parse or went past the turn's
limit. The other kinds are the tool's failures."""


@dataclass(frozen=True)
class ToolResult:
    id: str
    name: str
    content: str
    kind: str = ""
    """"" where the call ran and succeeded, else why not (see the proto's ToolResult.kind)."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.kind

    def to_proto(self) -> envs_pb2.ToolResult:
        return envs_pb2.ToolResult(
            id=self.id, name=self.name, content=self.content, kind=self.kind, seconds=self.seconds
        )

    @classmethod
    def from_proto(cls, msg: envs_pb2.ToolResult) -> ToolResult:
        return cls(msg.id, msg.name, msg.content, msg.kind, msg.seconds)


def to_struct(data: dict[str, Any] | None) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    struct.update(data or {})
    return struct


def from_struct(struct: struct_pb2.Struct) -> dict[str, Any]:
    """Struct numbers are doubles; whole ones come back as int so both clients return the same values."""
    return _ints(json_format.MessageToDict(struct))


def _ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value
