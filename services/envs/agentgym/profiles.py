"""One small profile per AgentGym family: its routes, field names, reply shapes, success rule, the task
indices its server serves, how it says a task is not valid, the actions it understands, and a random
policy that produces every action form it accepts (the tiny model's warm-start). See
shared/agentgym-protocol.md; to add a family, add one `Profile` to PROFILES."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _textcraft_action(action: str) -> str:
    """The reference client keeps only letters, digits, commas and spaces."""
    return re.sub(r"[^A-Za-z0-9, ]", "", action).strip()


def _wordle_action(action: str) -> str:
    """LMRL-Gym's Wordle wants the letters separated by spaces: `f r o w n`."""
    return " ".join("".join(action.split()).lower())


def _words_action(action: str) -> str:
    """Case and spacing do not matter to us; the maze server ignores anything but its exact phrases."""
    return " ".join(action.lower().split())


def _lines_starting(observation: str, prefix: str) -> list[str]:
    return [line.strip() for line in observation.splitlines() if line.strip().startswith(prefix)]


CRAFT_LINE = re.compile(r"craft\s+\d+\s+(.+?)\s+using\s+(.+)")
COUNTED = re.compile(r"(\d+)\s+(.+)")


def _random_textcraft(observation: str, rng: random.Random) -> str:
    """Every action form TextCraft takes: `inventory`, a listed craft line, and `get N <item>` for an
    ingredient no listed line crafts (a raw material), so a random policy can reach the goal."""
    lines = _lines_starting(observation, "craft ")
    crafted, ingredients = set(), []
    for line in lines:
        if m := CRAFT_LINE.fullmatch(line):
            crafted.add(m.group(1))
            ingredients += [c for part in m.group(2).split(",") if (c := COUNTED.fullmatch(part.strip()))]
    raw = [(int(c.group(1)), c.group(2)) for c in ingredients if c.group(2) not in crafted]
    choices = ["inventory"] + ([rng.choice(lines)] if lines else [])
    if raw:
        count, item = rng.choice(raw)
        choices.append(f"get {rng.choice([count, count, rng.randint(1, 4)])} {item}")
    return rng.choice(choices)


def _random_babyai(observation: str, rng: random.Random) -> str:
    listed = re.findall(r'"([a-z][a-z0-9 ]+)"', observation.rsplit("Available actions", 1)[-1])
    return rng.choice(listed or ["turn left", "turn right", "move forward"])


MAZE_MOVES = ("move up", "move down", "move left", "move right")


def _random_maze(observation: str, rng: random.Random) -> str:
    return rng.choice(MAZE_MOVES)


def _range_error(text: str) -> bool:
    """A reset that failed on the index itself (a list indexed past its end), in any family."""
    return "index out of range" in text


def _maze_rejects(text: str) -> bool:
    """LMRL-Gym maze serves games 0..24: 25 fails on an assertion with no message (an empty error),
    26 and above answer "The game N is not valid."."""
    return not text.strip() or bool(re.search(r"The game -?\d+ is not valid", text)) or _range_error(text)


def _random_wordle(observation: str, rng: random.Random, vocabulary: list[str] | None = None) -> str:
    """A word the server still allows (its filtered vocabulary), else five random letters."""
    if vocabulary:
        return _wordle_action(rng.choice(vocabulary))
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))


def _random_webshop(observation: str, rng: random.Random) -> str:
    words = re.findall(r"[a-z]{4,}", observation.lower()) or ["shirt"]
    return f"search[{' '.join(rng.sample(words, min(2, len(words))))}]"


@dataclass(frozen=True)
class Profile:
    family: str
    action_help: str
    """Appended to the first observation: what an action looks like."""
    action_example: str
    prefix: str = ""
    """Route prefix (LMRL-Gym serves /maze/... and /wordle/...)."""
    id_field: str = "id"
    task_field: str = "data_idx"
    """Reset body field that selects the task."""
    create_body: dict[str, Any] | None = None
    """JSON body of /create; None sends none."""
    create_returns: str = "object"
    """"object" ({"id": ...}) or "bare" (the id itself, WebShop)."""
    reset_returns: str = "object"
    """"object" ({"observation": ...}) or "pair" ([observation, info], WebShop)."""
    observation_key: str = "observation"
    """Key of the observation in /step replies ("state" for WebShop)."""
    has_close: bool = True
    close_needs_reset: bool = False
    """/close answers false for an environment that was never reset, and keeps it (BabyAI): a refused
    close is retried after a reset on a task known to answer."""
    id_reuse_after: int | None = None
    """The server hands out ids again after this many environments (WebShop: 8000)."""
    recycle_after: int | None = None
    """Default `recycle_after` option: environments created before the server is recycled."""
    clean_action: Callable[[str], str] = str.strip
    success: Callable[[float, bool, dict], bool] = lambda reward, done, body: done and reward >= 1.0
    random_action: Callable[[str, random.Random], str] = field(default=_random_textcraft)
    task_range: tuple[int, int] | None = None
    """[start, stop) of the task indices the server serves; None: not known (any index >= 0)."""
    rejects_task: Callable[[str], bool] = _range_error
    """True for the error text of a reset that failed because the task index is not valid there."""
    valid_actions: tuple[str, ...] | None = None
    """The exact actions the server understands, where it ignores others silently: anything else is
    answered here with what was wrong (the turn counts) instead of being sent."""
    reset_extra: dict[str, Any] = field(default_factory=dict)
    """Fields every reset body carries besides the id and the task (ALFWorld's required world_type)."""
    probe_range: bool = False
    """The server indexes a fixed list it loaded with the task (ALFWorld's games): where no `task_range`
    is configured, its length is probed at start-up. (SciWorld's list grows by a copy on every create,
    so a probe would differ from process to process.)"""
    vocabulary_route: str | None = None
    """GET route (with ?id=) listing the words the server still accepts; the random policy draws from it."""

    def route(self, name: str) -> str:
        return f"{self.prefix}/{name}"


PROFILES: dict[str, Profile] = {
    p.family: p
    for p in [
        Profile(
            "textcraft",
            "Actions look like: get 1 lapis lazuli, craft 1 blue dye using 1 lapis lazuli, inventory.",
            "inventory",
            create_body={"commands": None, "goal": None},
            clean_action=_textcraft_action,
        ),
        Profile(
            "babyai",
            "Answer with one of the available actions listed in the observation.",
            "turn left",
            success=lambda reward, done, body: done and reward > 0,
            random_action=_random_babyai,
            close_needs_reset=True,
        ),
        Profile(
            "maze",
            "Actions: move up, move down, move left, move right.",
            "move up",
            prefix="/maze",
            task_field="game",
            has_close=False,
            success=lambda reward, done, body: done and reward >= 0,
            random_action=_random_maze,
            task_range=(0, 25),
            rejects_task=_maze_rejects,
            valid_actions=MAZE_MOVES,
            clean_action=_words_action,
        ),
        Profile(
            "wordle",
            "Guess a five-letter word; write its letters separated by spaces, like c r a n e.",
            "c r a n e",
            prefix="/wordle",
            task_field="seed",
            has_close=False,
            clean_action=_wordle_action,
            random_action=_random_wordle,
            vocabulary_route="filtered_vocab",
        ),
        Profile(
            "webshop",
            "Actions: search[keywords] or click[value] (a button or item shown on the page).",
            "search[red shirt]",
            id_field="env_idx",
            task_field="session_id",
            create_returns="bare",
            reset_returns="pair",
            observation_key="state",
            has_close=False,
            id_reuse_after=8000,
            recycle_after=7000,
            random_action=_random_webshop,
        ),
        Profile(
            "alfworld",
            "Actions are household commands such as: go to countertop 1, take apple 1 from "
            "countertop 1, open fridge 1.",
            "look",
            task_field="game",
            reset_extra={"world_type": "Text"},
            probe_range=True,
        ),
        Profile(
            "sciworld",
            "Actions are science-lab commands such as: look around, open door to kitchen, pick up thermometer.",
            "look around",
            success=lambda reward, done, body: done and float(body.get("score", reward)) >= 100,
        ),
    ]
}
