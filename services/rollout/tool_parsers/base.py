"""How tool calls are read out of a model's reply: the formats models are trained to write. A parser never
re-tokenises or edits the reply; it only reads it."""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass, field
from typing import Any

from services.common.registry import Registry


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ParsedReply:
    calls: list[ParsedCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One line per call the reply tried to make but that did not parse: each is the model's mistake, answered
    with an error observation and counted."""

    @property
    def final(self) -> bool:
        """A reply with no call at all (made or tried): the agent's final answer."""
        return not self.calls and not self.errors


class ToolCallParser(abc.ABC):
    @abc.abstractmethod
    def parse(self, text: str) -> ParsedReply: ...

    @abc.abstractmethod
    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """A reply making these calls, as a model trained on the format writes it (the warm-start's demos)."""


def call_from_json(body: str) -> ParsedCall | str:
    """A call from a JSON object {"name": ..., "arguments": {...}} (arguments may also be a JSON string of an
    object, as some models write them); else what is wrong with it."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        return f"not valid JSON ({exc})"
    return call_from_object(data)


def call_from_object(data: Any) -> ParsedCall | str:
    if not isinstance(data, dict):
        return f"a tool call must be a JSON object, got {type(data).__name__}"
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return 'a tool call needs a "name" string'
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        return ParsedCall(name, arguments)  # checked as JSON by the env service, which answers what is wrong
    return ParsedCall(name, json.dumps(arguments))


TOOL_PARSERS: Registry[ToolCallParser] = Registry("tool-call parser", choice="tool_parser")
