"""Action templates: how an action is read out of the model's text. Add one with a module that
subclasses ActionParser and a `PARSERS.register_lazy(name, module)` line here."""

from services.rollout.action_parsers.base import PARSERS, ActionParser, ParsedAction

PARSERS.register_lazy("xml_action", "services.rollout.action_parsers.xml_tag")

__all__ = ["PARSERS", "ActionParser", "ParsedAction"]
