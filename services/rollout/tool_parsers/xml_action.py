from __future__ import annotations

import json
import re
from typing import Any

from services.rollout.tool_parsers.base import TOOL_PARSERS, ParsedReply, ToolCallParser, call_from_json

_ACTION = re.compile(r"<action>(.*?)</action>", re.DOTALL)


@TOOL_PARSERS.register("xml_action")
class XmlActionParser(ToolCallParser):
    """Today's action tag carrying calls: `<action>{"name": ..., "arguments": {...}}</action>`. An action whose
    text is not a JSON object is no call: the reply is the final answer, read by the run's action parser."""

    def parse(self, text: str) -> ParsedReply:
        calls, errors = [], []
        for i, body in enumerate(_ACTION.findall(text), 1):
            body = body.strip()
            if not body.startswith("{"):
                continue
            call = call_from_json(body)
            if isinstance(call, str):
                errors.append(f"tool call {i}: {call}")
            else:
                calls.append(call)
        return ParsedReply(calls, errors)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "".join(
            f"<action>{json.dumps({'name': name, 'arguments': arguments})}</action>" for name, arguments in calls
        )
