from __future__ import annotations

import json
import re
from typing import Any

from services.rollout.tool_parsers.base import TOOL_PARSERS, ParsedReply, ToolCallParser, call_from_json

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@TOOL_PARSERS.register("hermes")
class HermesParser(ToolCallParser):
    """Hermes / Qwen2.5 / Qwen3 calls: each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several
    per reply. An opening tag without its closing one (a reply cut at the token limit) is a failed call."""

    def parse(self, text: str) -> ParsedReply:
        calls, errors = [], []
        for i, body in enumerate(_CALL.findall(text), 1):
            call = call_from_json(body.strip())
            if isinstance(call, str):
                errors.append(f"tool call {i}: {call}")
            else:
                calls.append(call)
        if text.count("<tool_call>") > text.count("</tool_call>"):
            errors.append("a <tool_call> without its </tool_call>")
        return ParsedReply(calls, errors)

    def format_calls(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(
            f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>" for name, arguments in calls
        )
