"""Guess the number: find a secret in [1, max_number] from higher/lower feedback. Binary search needs
at most ceil(log2 n)+1 guesses, which is the turn limit."""

from __future__ import annotations

import random

from pydantic import Field

from services.envs.base import EnvOptions, InvalidTask, StepResult, TextEnv, action_format
from services.envs.registry import register_env


class GuessNumberOptions(EnvOptions):
    max_number: int = Field(16, ge=1, le=10**12)
    max_turns: int | None = Field(None, ge=1, le=1000)
    """Default: ceil(log2 max_number) + 1."""


def turn_limit(n: int) -> int:
    return (n - 1).bit_length() + 1


@register_env("guess_number")
class GuessNumber(TextEnv):
    description = "Find a secret number from higher/lower feedback."
    max_turns = turn_limit(16)
    runs_inline = True
    Options = GuessNumberOptions

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        if task_index < 0:
            raise InvalidTask(f"task_index must be >= 0, got {task_index}")
        self.n = opts.max_number
        self.max_turns = opts.max_turns or turn_limit(self.n)
        self.secret = random.Random(task_index).randint(1, self.n)
        self.turn, self.low, self.high = 0, 1, self.n
        return (
            f"I am thinking of a whole number from 1 to {self.n}. Find it within {self.max_turns} guesses; "
            f"after each guess I say higher, lower or correct. {action_format(str((self.n + 1) // 2))}"
        )

    def task_info(self) -> dict:
        return {"secret": self.secret}

    def anchor_observation(self) -> str:
        """What the feedback so far has narrowed the secret to, whatever guesses got there."""
        return f"The number is from {self.low} to {self.high}."

    def random_action(self, rng: random.Random) -> str:
        return str(rng.randint(1, self.n))

    def step(self, action: str) -> StepResult:
        self.turn += 1
        left = self.max_turns - self.turn
        try:
            guess = int(action.strip())
            valid = 1 <= guess <= self.n
        except ValueError:
            guess, valid = None, False
        info = {"turn": self.turn, "action_valid": valid}
        if valid and guess == self.secret:
            return StepResult(f"{guess}: correct!", 1.0, True, True, info)
        if valid and self.secret > guess:
            self.low = max(self.low, guess + 1)
        elif valid:
            self.high = min(self.high, guess - 1)
        if not valid:
            text = f"Invalid guess {action.strip()[:40]!r}: answer a whole number from 1 to {self.n}."
        else:
            text = f"{guess}: {'higher' if self.secret > guess else 'lower'}."
        if left <= 0:
            return StepResult(f"{text} Out of guesses; the number was {self.secret}.", 0.0, True, False, info)
        return StepResult(f"{text} {left} guesses left.", 0.0, False, False, info)
