"""Single-turn verifiable tasks from `reasoning-gym` (procedural generators with answer checkers, all
offline): arithmetic, puzzles, logic, ... — any of its ~100 datasets.

Task i is item i of the dataset built with `dataset`, `config` and `seed`, so a task index always
gives the same question. The agent answers once; the reward is the dataset's own score of the answer
(1.0 for a right answer; some datasets give partial credit) and success means a score of 1.

Difficulty: `dataset` and its `config` (e.g. basic_arithmetic with {"max_terms": 2, "max_digits": 1}
is easy, the defaults are hard); see reasoning-gym's dataset configs.
Needs the optional extra: `pip install -e ".[envs]"` (scripts/setup.sh installs it).
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

from pydantic import field_validator

from services.envs.base import EnvOptions, InvalidTask, MissingDependency, StepResult, TextEnv, action_format
from services.envs.registry import register_env

MISSING = 'the reasoning env needs the `reasoning-gym` package: pip install -e ".[envs]" (scripts/setup.sh installs it)'

CHOICE_PAIRS = [("Yes", "No"), ("yes", "no"), ("True", "False"), ("true", "false")]


class ReasoningOptions(EnvOptions):
    dataset: str = "basic_arithmetic"
    """reasoning-gym dataset name."""
    config: dict[str, Any] | None = None
    """That dataset's config (its difficulty); default: the dataset's own, except for basic_arithmetic
    where it is one-digit sums and differences of two terms."""
    seed: int = 0
    """Dataset seed; with the task index it fixes the question."""

    @field_validator("config")
    @classmethod
    def _files_are_names(cls, config: dict[str, Any] | None) -> dict[str, Any] | None:
        stack: list[Any] = [config]
        while stack:  # composite's datasets hold configs of their own
            item = stack.pop()
            if isinstance(item, dict):
                for key, value in item.items():
                    if key in FILE_NAME_KEYS and not _bare_name(value):
                        raise ValueError(f"config {key}: {value!r} is not the name of a file reasoning-gym ships")
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
        return config


FILE_NAME_KEYS = frozenset({"data_file", "static_font"})
"""Config keys reasoning-gym turns into a file it reads (spell_backward's word list, figlet_font's font): a name of
a file it ships, never a path (it joins the name to its own folder, where an absolute path would escape)."""


def _bare_name(value: Any) -> bool:
    return value is None or (
        isinstance(value, str) and bool(value) and not value.startswith(".") and not set(value) & set("/\\\0")
    )


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int):
    try:
        import reasoning_gym
    except ImportError:
        raise MissingDependency(MISSING) from None
    try:
        # size only bounds iteration; item i depends on (seed, i) alone
        return reasoning_gym.create_dataset(name, seed=seed, size=10**9, **json.loads(config_json))
    except (ValueError, TypeError, AssertionError) as exc:
        raise InvalidTask(f"reasoning-gym dataset {name!r}: {exc}") from None


EASY_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}


def dataset(opts: ReasoningOptions):
    config = opts.config if opts.config is not None else (EASY_ARITHMETIC if opts.dataset == "basic_arithmetic" else {})
    return _dataset(opts.dataset, json.dumps(config, sort_keys=True), opts.seed)


@register_env("reasoning")
class Reasoning(TextEnv):
    description = "Single-turn verifiable questions from reasoning-gym (arithmetic, puzzles, logic)."
    max_turns = 1
    Options = ReasoningOptions

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        self.data = dataset(opts)
        self.entry = self.data[task_index]
        return f"{self.entry['question']}\n{action_format('your final answer')}"

    @property
    def answer(self) -> str:
        return str(self.entry["answer"])

    def task_info(self) -> dict:
        return {"answer": self.answer, "dataset": self.data.__class__.__name__}

    def random_action(self, rng: random.Random) -> str:
        """A wrong-or-right answer of the right shape, never biased towards the true one: either word of a
        yes/no or true/false pair, the true answer's digits redrawn, or its letters shuffled."""
        for pair in CHOICE_PAIRS:
            if self.answer in pair:
                return rng.choice(pair)
        if any(ch.isdigit() for ch in self.answer):
            return "".join(str(rng.randint(0, 9)) if ch.isdigit() else ch for ch in self.answer)
        return "".join(rng.sample(self.answer, len(self.answer)))

    def step(self, action: str) -> StepResult:
        score = float(self.data.score_answer(action.strip(), self.entry) or 0.0)
        success = score >= 1.0
        verdict = "Correct." if success else f"Not correct; the answer was {self.answer}."
        return StepResult(verdict, score, True, success, {"score": score, "action_valid": bool(action.strip())})
