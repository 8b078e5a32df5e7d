"""Tool-call formats of the tool-calling agent loop (`rollout.tool_parser`). Add one with a module that subclasses
ToolCallParser and a `TOOL_PARSERS.register_lazy(name, module)` line here."""

from services.rollout.tool_parsers.base import TOOL_PARSERS, ParsedCall, ParsedReply, ToolCallParser

TOOL_PARSERS.register_lazy("hermes", "services.rollout.tool_parsers.hermes")
TOOL_PARSERS.register_lazy("json", "services.rollout.tool_parsers.json_reply")
TOOL_PARSERS.register_lazy("xml_action", "services.rollout.tool_parsers.xml_action")

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedReply", "ToolCallParser"]
