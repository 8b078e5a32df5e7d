"""A rule per turn (a process reward): did the turn take the action the state it acted from called for?

`hints` maps a phrase to an action: a turn whose anchor observation (the env's text for the state it acted from,
`Turn.anchor`) contains the phrase scores `match` when its parsed action is that action (case and surrounding
space ignored) and `mismatch` when it is another or none parsed. A turn whose state holds no phrase, or phrases
calling for different actions, scores 0. E.g. corridor's observations end with "The exit is to the left."."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from services.reward.base import TurnRewardFunction

Phrase = Annotated[str, Field(min_length=1, max_length=1000)]


class HintedAction(TurnRewardFunction):
    name = "hinted_action"

    def __init__(
        self,
        hints: Annotated[dict[Phrase, Annotated[str, Field(max_length=1000)]], Field(min_length=1, max_length=1000)],
        match: float = 1.0,
        mismatch: float = 0.0,
    ):
        if not isinstance(hints, dict) or not hints:
            raise ValueError("hints must map at least one phrase to the action it calls for")
        for phrase, action in hints.items():
            if not isinstance(phrase, str) or not phrase or not isinstance(action, str) or not action.strip():
                raise ValueError(f"hint {phrase!r}: {action!r}: a phrase and an action, both non-empty text")
        for param, value in (("match", match), ("mismatch", mismatch)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{param} must be a number, got {value!r}")
        self.hints = {phrase: action.strip().lower() for phrase, action in hints.items()}
        self.match, self.mismatch = float(match), float(mismatch)

    def score_turns(self, traj) -> list[float]:
        return [self._score(turn) for turn in traj.turns]

    def _score(self, turn) -> float:
        called = {action for phrase, action in self.hints.items() if phrase in turn.anchor}
        if len(called) != 1:
            return 0.0
        taken = turn.action.strip().lower() if turn.action_valid else ""
        return self.match if taken in called else self.mismatch
