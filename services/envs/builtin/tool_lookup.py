"""Tool lookup: a question ("In which year was the city of Varnholt founded?") whose answer is one fact of the
built-in `facts` search corpus, answered with the number.

The facts are invented (made-up names from syllables, random numbers), so no model knows them: the only way to
the answer is to search the corpus and read the number off the document found. Every fact has its own name,
which no other document contains, and the question repeats it, so a BM25 search with the question's words
ranks the fact first. The corpus is the same for every option and process (a fixed seed): the search toolset
names it `builtin:facts`.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from services.envs.base import EnvOptions, InvalidTask, StepResult, TextEnv, action_format
from services.envs.builtin.tool_arith import parse_integer
from services.envs.registry import register_env
from services.envs.tools.corpora import CORPORA, Document

CORPUS_SIZE = 500
CORPUS_SEED = 20240611


@dataclass(frozen=True)
class Kind:
    name: str
    fact: str
    question: str
    low: int
    high: int


KINDS = (
    Kind(
        "city",
        "The city of {name} was founded in the year {value}.",
        "In which year was the city of {name} founded?",
        1000,
        1999,
    ),
    Kind(
        "river",
        "The river {name} is {value} kilometres long.",
        "How many kilometres long is the river {name}?",
        100,
        4999,
    ),
    Kind(
        "mountain",
        "Mount {name} rises {value} metres above sea level.",
        "How many metres above sea level does Mount {name} rise?",
        1000,
        8999,
    ),
    Kind("lake", "Lake {name} is {value} metres deep.", "How many metres deep is Lake {name}?", 20, 1999),
    Kind(
        "island",
        "The island of {name} has {value} inhabitants.",
        "How many inhabitants does the island of {name} have?",
        1000,
        99999,
    ),
)
KIND = {kind.name: kind for kind in KINDS}
FACT_VALUE = re.compile(r"(?<= )\d+(?=[ .])")
"""A fact's number in a document's text: after a space, before a space or the sentence's end."""
ONSETS = (
    "b",
    "br",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "kr",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "st",
    "t",
    "th",
    "v",
    "w",
    "z",
)
VOWELS = ("a", "e", "i", "o", "u", "ae", "ei", "ou")
CODAS = ("", "", "l", "n", "r", "s", "th", "lt", "rn", "ss", "nd", "x")


@dataclass(frozen=True)
class Fact:
    id: str
    kind: str
    name: str
    value: int

    @property
    def text(self) -> str:
        return KIND[self.kind].fact.format(name=self.name, value=self.value)

    @property
    def question(self) -> str:
        return KIND[self.kind].question.format(name=self.name)


def _name(rng: random.Random) -> str:
    return "".join(
        rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(rng.choice((2, 2, 3)))
    ).capitalize()


@functools.lru_cache(maxsize=1)
def facts() -> tuple[Fact, ...]:
    """The corpus's facts, kinds in turn; no name contains another, so a name occurs in its own document only."""
    rng = random.Random(CORPUS_SEED)
    names: list[str] = []
    while len(names) < CORPUS_SIZE:
        name = _name(rng)
        if len(name) >= 5 and not any(name in other or other in name for other in names):
            names.append(name)
    found = []
    for i, name in enumerate(names):
        kind = KINDS[i % len(KINDS)]
        found.append(Fact(f"fact-{i + 1:04d}", kind.name, name, rng.randint(kind.low, kind.high)))
    return tuple(found)


def fact_names() -> list[str]:
    """Every fact's invented name: the tiny tokenizer's whole words for the envs that search the facts."""
    return [fact.name for fact in facts()]


@CORPORA.register("facts")
def facts_corpus() -> list[Document]:
    return [{"id": fact.id, "text": fact.text} for fact in facts()]


def random_query(rng: random.Random, question: str, name: str | None = None) -> str:
    """A few of the question's words, in order: a search a plausible (not necessarily good) agent would make.
    With `name` (a word of the question) the other words are drawn and the name is added to them."""
    words = question.replace("?", "").split()
    others = [i for i, word in enumerate(words) if word != name]
    picked = set(rng.sample(others, rng.randint(min(2, len(others)), min(5, len(others)))))
    if name in words:
        picked.add(words.index(name))
    return " ".join(words[i] for i in sorted(picked))


def random_number_like(rng: random.Random, value: int) -> str:
    width = len(str(abs(value)))
    return str(rng.randint(10 ** (width - 1) if width > 1 else 0, 10**width - 1))


SEARCH_SENTENCE = "The answer is in a collection of documents that you can search with the search tool."


class ToolLookupOptions(EnvOptions):
    seed: int = Field(0, ge=0)
    """Another seed gives other tasks for the same indices (the corpus stays the same)."""
    max_turns: int = Field(4, ge=1, le=100)
    """Turns for tool calls and the final answer."""


@register_env("tool_lookup")
class ToolLookup(TextEnv):
    description = "Answer a question about an invented fact by searching a corpus of documents."
    max_turns = 4
    runs_inline = True
    Options = ToolLookupOptions
    tools = {"search": {"type": "search", "options": {"corpus": "builtin:facts"}}}

    @classmethod
    def whole_words(cls, options: dict[str, Any] | None) -> list[str]:
        return fact_names()

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        if task_index < 0:
            raise InvalidTask(f"task_index must be >= 0, got {task_index}")
        self.max_turns = opts.max_turns
        self.fact = random.Random(f"{opts.seed}:{task_index}").choice(facts())
        self.question = self.fact.question
        return f"{self.question} {SEARCH_SENTENCE} Give the number as your final answer. {action_format('1234')}"

    def task_info(self) -> dict:
        return {"answer": str(self.fact.value)}

    def random_action(self, rng: random.Random) -> str:
        return random_number_like(rng, self.fact.value)

    def random_answer(self, rng: random.Random, seen: list[str]) -> str:
        """A number copied from the search's hits: the first hit's one time in seven, the second's or the third's two
        times in seven each, else a made-up one (also where there is no such hit). Most demos copy a number from a
        document, so the warm-start learns to copy; which hit to copy from is what RL learns."""
        results = next((text for text in seen if FACT_VALUE.search(text)), "")
        values = [found[0] for hit in results.split("\n\n") if (found := FACT_VALUE.findall(hit))]
        pick = rng.choices(range(4), weights=(1, 2, 2, 2))[0]
        return values[pick] if pick < min(3, len(values)) else self.random_action(rng)

    def random_tool_calls(self, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        """A query of the fact's name and random other words of the question, in the question's order: the search
        then shows the fact first. Names are one token each in the tiny model's tokenizer (`whole_words`)."""
        return [("search", {"query": random_query(rng, self.question, self.fact.name)})]

    def step(self, action: str) -> StepResult:
        given = parse_integer(action)
        info = {"action_valid": given is not None, "answer": str(self.fact.value), "fact": self.fact.id}
        if given == self.fact.value:
            return StepResult(f"Correct: {self.fact.value}.", 1.0, True, True, info)
        return StepResult(f"Wrong: the answer was {self.fact.value}.", 0.0, True, False, info)
