from __future__ import annotations

import abc
from dataclasses import dataclass

from services.common.registry import Registry


@dataclass(frozen=True)
class ParsedAction:
    action: str
    valid: bool
    error: str = ""


class ActionParser(abc.ABC):
    @abc.abstractmethod
    def parse(self, text: str) -> ParsedAction: ...

    @abc.abstractmethod
    def format_hint(self) -> str:
        """What the model is told when its reply could not be parsed."""


PARSERS: Registry[ActionParser] = Registry("action parser", choice="action_parser")
