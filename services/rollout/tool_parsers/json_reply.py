from __future__ import annotations

import json
import re
from typing import Any

from services.rollout.tool_parsers.base import TOOL_PARSERS, ParsedReply, ToolCallParser, call_from_object

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@TOOL_PARSERS.register("json")
class JsonParser(ToolCallParser):
    """A reply that is one JSON value (bare, or in a ```json fence): an object {"name", "arguments"} is one
    call, a list of them several. A reply that does not start like JSON is the final answer; one that does but
    does not parse is a failed call."""

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        fenced = _FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        if not body.startswith(("{", "[")):
            return ParsedReply()
        try:
            data = json.loads(body)
        except ValueError as exc:
            return ParsedReply(errors=[f"the reply is not valid JSON ({exc})"])
        calls, errors = [], []
        for i, item in enumerate(data if isinstance(data, list) else [data], 1):
            call = call_from_object(item)
            if isinstance(call, str):
                errors.append(f"tool call {i}: {call}")
            else:
                calls.append(call)
        return ParsedReply(calls, errors)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        objects = [{"name": name, "arguments": arguments} for name, arguments in calls]
        return json.dumps(objects[0] if len(objects) == 1 else objects)
