"""Tool chain: a question that combines two facts of the built-in `facts` corpus ("How many years passed between
the founding of the city of Varnholt and the founding of the city of Quessel?"), answered with the number.

It takes two tools in sequence: the facts are invented, so only a search finds the two numbers (one search per
name, or one for both), and their sum or difference (of three- to five-digit numbers) is what a tiny model gets
wrong in its head and a calculator gets right. The corpus is tool_lookup's.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field

from services.envs.base import EnvOptions, InvalidTask, StepResult, TextEnv, action_format, seen_number
from services.envs.builtin.tool_arith import parse_integer
from services.envs.builtin.tool_lookup import (
    SEARCH_SENTENCE,
    Fact,
    fact_names,
    facts,
    random_number_like,
    random_query,
)
from services.envs.registry import register_env

QUESTIONS = {
    "city": ("How many years passed between the founding of the city of {a} and the founding of the city of {b}?", "-"),
    "river": ("What is the combined length of the rivers {a} and {b}, in kilometres?", "+"),
    "mountain": ("How many metres higher is Mount {a} than Mount {b}?", "-"),
    "lake": ("How many metres deeper is Lake {a} than Lake {b}?", "-"),
    "island": ("How many inhabitants do the islands of {a} and {b} have together?", "+"),
}
"""Per kind of fact: the question about two facts {a} and {b} and how it combines them ("-": the larger minus
the smaller, {a} being the larger)."""


class ToolChainOptions(EnvOptions):
    seed: int = Field(0, ge=0)
    """Another seed gives other tasks for the same indices (the corpus stays the same)."""
    max_turns: int = Field(6, ge=1, le=100)
    """Turns for tool calls and the final answer."""


@register_env("tool_chain")
class ToolChain(TextEnv):
    description = "Combine two invented facts found by searching a corpus with a calculator."
    max_turns = 6
    runs_inline = True
    Options = ToolChainOptions
    tools = {
        "search": {"type": "search", "options": {"corpus": "builtin:facts"}},
        "calculator": {"type": "calculator"},
    }

    @classmethod
    def whole_words(cls, options: dict[str, Any] | None) -> list[str]:
        return fact_names()

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        if task_index < 0:
            raise InvalidTask(f"task_index must be >= 0, got {task_index}")
        self.max_turns = opts.max_turns
        rng = random.Random(f"{opts.seed}:{task_index}")
        kind = rng.choice(sorted(QUESTIONS))
        template, self.op = QUESTIONS[kind]
        a, b = self._pair(rng, [fact for fact in facts() if fact.kind == kind])
        self.facts = (a, b)
        self.answer = a.value + b.value if self.op == "+" else a.value - b.value
        self.question = template.format(a=a.name, b=b.name)
        return (
            f"{self.question} {SEARCH_SENTENCE} You can also call the calculator tool, which evaluates an arithmetic "
            f"expression. Give the number as your final answer. {action_format('1234')}"
        )

    def _pair(self, rng: random.Random, candidates: list[Fact]) -> tuple[Fact, Fact]:
        """Two facts with different values, the larger first where the question subtracts."""
        while True:
            a, b = rng.sample(candidates, 2)
            if a.value != b.value:
                return (a, b) if self.op == "+" or a.value > b.value else (b, a)

    def task_info(self) -> dict:
        return {"answer": str(self.answer)}

    def random_action(self, rng: random.Random) -> str:
        return random_number_like(rng, self.answer)

    def random_answer(self, rng: random.Random, seen: list[str]) -> str:
        return seen_number(rng, seen, self.random_action(rng))

    def random_tool_calls(self, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        a, b = self.facts
        return [
            ("search", {"query": random_query(rng, self.question)}),
            ("calculator", {"expression": f"{a.value} {rng.choice(['+', '-', '*'])} {b.value}"}),
        ]

    def step(self, action: str) -> StepResult:
        given = parse_integer(action)
        info = {"action_valid": given is not None, "answer": str(self.answer), "facts": [f.id for f in self.facts]}
        if given == self.answer:
            return StepResult(f"Correct: {self.answer}.", 1.0, True, True, info)
        return StepResult(f"Wrong: the answer was {self.answer}.", 0.0, True, False, info)
