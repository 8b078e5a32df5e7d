"""Wordle: find a secret five-letter word from per-letter feedback.

The secret is drawn, from the task's seed, out of the first `vocabulary` words of the word list the
project ships (`data/wordle_words.txt`, 478 common English words, in a fixed shuffled order). After
each guess every letter is marked G (right letter, right place), Y (in the word, elsewhere) or _ (not
in the word, or no more copies of it), with Wordle's rules for repeated letters.

Difficulty: `vocabulary` (how many words the secret may be), `max_turns`, and `dictionary_only`
(guesses must be words of the list, as in the real game). A guess is five letters, written together
(`crane`) or spaced as LMRL-Gym's Wordle expects (`c r a n e`). Reward 1 and success when the secret
is guessed, else 0.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

from pydantic import Field

from services.envs.base import EnvOptions, StepResult, TextEnv, action_format
from services.envs.registry import register_env

WORDS_FILE = Path(__file__).with_name("data") / "wordle_words.txt"


@functools.cache
def word_list() -> tuple[str, ...]:
    words = [w.strip() for w in WORDS_FILE.read_text().split()]
    random.Random("wordle-order").shuffle(words)  # so any prefix spans the alphabet
    return tuple(words)


def feedback(guess: str, secret: str) -> str:
    marks, left = ["_"] * 5, list(secret)
    for i, (g, s) in enumerate(zip(guess, secret)):
        if g == s:
            marks[i] = "G"
            left.remove(g)
    for i, g in enumerate(guess):
        if marks[i] == "_" and g in left:
            marks[i] = "Y"
            left.remove(g)
    return "".join(marks)


class WordleOptions(EnvOptions):
    vocabulary: int = Field(100, ge=1, le=len(word_list()))
    """The secret is one of the first `vocabulary` words of the shipped list."""
    max_turns: int = Field(6, ge=1, le=100)
    """Guesses allowed."""
    dictionary_only: bool = False
    """Reject guesses that are not in the word list."""


@register_env("wordle")
class Wordle(TextEnv):
    description = "Guess a secret five-letter word from per-letter feedback."
    max_turns = 6
    runs_inline = True
    Options = WordleOptions

    def reset(self, task_index: int, options: dict) -> str:
        self.opts = opts = self.parse_options(options)
        self.candidates = word_list()[: opts.vocabulary]
        self.secret = random.Random(f"wordle:{task_index}").choice(self.candidates)
        self.max_turns, self.turn, self.known = opts.max_turns, 0, set()
        return (
            f"Guess the secret five-letter English word within {self.max_turns} guesses. After each guess "
            f"every letter is marked G (right place), Y (in the word, elsewhere) or _ (not in the word). "
            f"{action_format('crane')}"
        )

    def task_info(self) -> dict:
        return {"secret": self.secret}

    def anchor_observation(self) -> str:
        """The feedback gathered so far, in any order: what a state of this task is."""
        return " ".join(sorted(self.known)) or "No guesses yet."

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(self.candidates)

    def step(self, action: str) -> StepResult:
        self.turn += 1
        guess = "".join(action.split()).lower()
        valid = len(guess) == 5 and guess.isascii() and guess.isalpha()
        if valid and self.opts.dictionary_only and guess not in word_list():
            valid, problem = False, f"{guess!r} is not in the word list"
        else:
            problem = f"{action.strip()[:40]!r} is not five letters"
        info = {"turn": self.turn, "action_valid": valid}
        if valid and guess == self.secret:
            return StepResult(f"{guess}: GGGGG, you found the word!", 1.0, True, True, info)
        if valid:
            self.known.add(f"{guess}->{feedback(guess, self.secret)}")
        text = f"{guess} -> {feedback(guess, self.secret)}." if valid else f"Invalid guess: {problem}."
        left = self.max_turns - self.turn
        if left <= 0:
            return StepResult(f"{text} Out of guesses; the word was {self.secret}.", 0.0, True, False, info)
        return StepResult(f"{text} {left} guesses left.", 0.0, False, False, info)
