from __future__ import annotations

import re

from services.rollout.action_parsers.base import PARSERS, ActionParser, ParsedAction


@PARSERS.register("xml_action")
class XmlTagParser(ActionParser):
    """Exactly one `<tag>...</tag>` pair; the stripped text inside is the action."""

    def __init__(self, tag: str = "action", max_action_chars: int = 512):
        self.tag, self.max_action_chars = tag, max_action_chars
        self._pair = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)

    def parse(self, text: str) -> ParsedAction:
        found = self._pair.findall(text)
        if len(found) != 1:
            return ParsedAction("", False, f"expected exactly one <{self.tag}>...</{self.tag}>, found {len(found)}")
        action = found[0].strip()
        if not action:
            return ParsedAction("", False, f"empty <{self.tag}>")
        if len(action) > self.max_action_chars:
            return ParsedAction("", False, f"action longer than {self.max_action_chars} characters")
        return ParsedAction(action, True)

    def format_hint(self) -> str:
        return f"Invalid format. Reply with exactly one <{self.tag}>...</{self.tag}>."
