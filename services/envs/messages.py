"""What the env service hands back, and its wire form (both clients return these, never protos)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from google.protobuf import json_format, struct_pb2

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

    def to_proto(self) -> envs_pb2.EpisodeState:
        return envs_pb2.EpisodeState(
            episode_id=self.episode_id,
            observation=self.observation,
            reward=self.reward,
            done=self.done,
            success=self.success,
            info=to_struct(self.info),
            anchor=self.anchor,
        )

    @classmethod
    def from_proto(cls, msg: envs_pb2.EpisodeState) -> EpisodeState:
        """A server that predates anchors sends none: its observation is the anchor then."""
        anchor = msg.anchor or msg.observation
        return cls(msg.episode_id, msg.observation, msg.reward, msg.done, msg.success, from_struct(msg.info), anchor)


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
