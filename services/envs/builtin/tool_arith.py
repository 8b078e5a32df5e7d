"""Tool arithmetic: "What is 48213 + 90377?", answered with the exact integer.

The numbers have `digits` digits each (5 by default), too many for a tiny model to add or multiply in its head
with any reliability, while one calculator (or python) call gets the answer exactly: the task teaches calling a
tool and copying its result into the final answer. One answer ends the episode; commas and surrounding
whitespace in it are ignored.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field

from services.envs.base import NUMBER, EnvOptions, InvalidTask, StepResult, TextEnv, action_format
from services.envs.registry import register_env

Operator = Literal["+", "-", "*"]
DEMO_OPERATORS = ("+", "-", "*", "/", "//", "%")
TOOLS: dict[str, dict[str, dict[str, Any]]] = {
    "calculator": {"calculator": {"type": "calculator"}},
    "python": {"python": {"type": "python"}},
}
TOOL_SENTENCES = {
    "calculator": "You can call the calculator tool, which evaluates an arithmetic expression.",
    "python": "You can call the python tool, which runs a Python program and returns what it prints.",
}


class ToolArithOptions(EnvOptions):
    digits: int = Field(5, ge=1, le=30)
    """Digits of each operand."""
    operations: list[Operator] = Field(["+"], min_length=1, max_length=3)
    """The operators a task draws from."""
    tool: Literal["calculator", "python"] = "calculator"
    """The toolset the task is played with."""
    seed: int = Field(0, ge=0)
    """Another seed gives other tasks for the same indices."""
    max_turns: int = Field(4, ge=1, le=100)
    """Turns for tool calls and the final answer."""


def parse_integer(text: str) -> int | None:
    """An integer answer with commas and surrounding whitespace ignored; None where it is not one."""
    try:
        return int(text.strip().replace(",", ""))
    except ValueError:
        return None


@register_env("tool_arith")
class ToolArith(TextEnv):
    description = "Compute a sum, difference or product of long numbers with a calculator or python tool."
    max_turns = 4
    runs_inline = True
    Options = ToolArithOptions
    tools = TOOLS["calculator"]

    @classmethod
    def tools_for(cls, options: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        return dict(TOOLS[cls.parse_options(options).tool])

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        if task_index < 0:
            raise InvalidTask(f"task_index must be >= 0, got {task_index}")
        rng = random.Random(f"{opts.seed}:{task_index}")
        low, high = 10 ** (opts.digits - 1), 10**opts.digits - 1
        self.opts, self.max_turns = opts, opts.max_turns
        self.a, self.b = rng.randint(low, high), rng.randint(low, high)
        self.op = rng.choice(opts.operations)
        self.answer = {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]
        return (
            f"{TOOL_SENTENCES[opts.tool]} Give the exact integer as your final answer. {action_format('12345')} "
            f'What is "{self.a}{self.op}{self.b}"?'
        )

    def task_info(self) -> dict:
        return {"answer": str(self.answer)}

    def random_action(self, rng: random.Random) -> str:
        width = len(str(abs(self.answer)))
        return ("-" if self.answer < 0 else "") + str(rng.randint(10 ** (width - 1) if width > 1 else 0, 10**width - 1))

    def random_answer(self, rng: random.Random, seen: list[str]) -> str:
        """The first number the tool returned two times in three, else one of the question's numbers: the random
        parts are the call's operator and which number is copied, so a demo is right at most one time in nine. A
        policy warm-started on them starts below 20%: 14.6% of 512 held-out tasks, writing the question's `+` in 25%
        of its calls (docs/tools.md)."""
        numbers = [n for text in seen for n in NUMBER.findall(text)]
        if not numbers:
            return self.random_action(rng)
        said = numbers[0].replace(",", "")
        return rng.choice([said, said, str(rng.choice([self.a, self.b]))])

    def random_tool_calls(self, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        """The task's numbers with an operator drawn from six."""
        expression = f"{self.a}{rng.choice(DEMO_OPERATORS)}{self.b}"
        if self.opts.tool == "python":
            return [("python", {"code": f"print({expression})"})]
        return [("calculator", {"expression": expression})]

    def step(self, action: str) -> StepResult:
        given = parse_integer(action)
        info = {"action_valid": given is not None, "answer": str(self.answer)}
        if given == self.answer:
            return StepResult(f"Correct: {self.answer}.", 1.0, True, True, info)
        if given is None:
            return StepResult(
                f"{action.strip()[:40]!r} is not an integer; the answer was {self.answer}.", 0.0, True, False, info
            )
        return StepResult(f"Wrong: the answer was {self.answer}.", 0.0, True, False, info)
