"""Corridor: walk left or right along a row of cells to the exit.

The default training task, small enough for a 2-layer transformer to learn in a few dozen RL steps:
with `hint` on, every observation says which side the exit is on, so the optimal policy is "move
towards the hint". The exit is exactly `distance` cells from the start, and the start never touches
the wall behind it, so walls never help a wandering agent. With the defaults (length 8, distance 3,
4 turns) a uniformly random left/right policy succeeds 1/8 = 12.5% of the time: only the 3 moves
straight to the exit succeed (after 4 moves the parity is wrong). Tests hold the env to this number.

`distances` (instead of `distance`) mixes difficulties: task i's exit is `distances[i % len(distances)]` cells
away, e.g. `{length: 8, distances: [1, 3, 5], max_turns: 3}` makes a third of the tasks easy, a third hard
and a third impossible (5 cells in 3 moves).
"""

from __future__ import annotations

import random
from typing import Annotated

from pydantic import Field, model_validator

from services.envs.base import EnvOptions, InvalidTask, StepResult, TextEnv, action_format
from services.envs.registry import register_env


class CorridorOptions(EnvOptions):
    length: int = Field(8, ge=3, le=1000)
    distance: int = Field(3, ge=1)
    distances: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=1, max_length=1000)
    hint: bool = True
    max_turns: int = Field(4, ge=1, le=1000)

    @model_validator(mode="after")
    def _fits(self) -> CorridorOptions:
        if self.distances and "distance" in self.model_fields_set:
            raise ValueError("set distance or distances, not both")
        for distance in self.distances or [self.distance]:
            if distance + 2 > self.length:
                raise ValueError(f"distance {distance} needs length >= {distance + 2}")
        return self

    def distance_of(self, task_index: int) -> int:
        """The exit's distance in task `task_index`."""
        return self.distances[task_index % len(self.distances)] if self.distances else self.distance


@register_env("corridor")
class Corridor(TextEnv):
    description = "Walk left or right along a corridor to the exit."
    max_turns = 4
    runs_inline = True
    Options = CorridorOptions

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        if task_index < 0:
            raise InvalidTask(f"task_index must be >= 0, got {task_index}")
        self.opts, self.max_turns, self.turn = opts, opts.max_turns, 0
        length, d = opts.length, opts.distance_of(task_index)
        # one free cell behind the start on the side away from the exit (see the module docstring)
        starts = [(s, s + d) for s in range(1, length - d)] + [(s, s - d) for s in range(d, length - 1)]
        self.position, self.exit = random.Random(task_index).choice(starts)
        return (
            f"You are in a corridor of cells 0 to {length - 1} and must reach the exit within "
            f"{opts.max_turns} moves. Each turn, move left or right. {action_format('left')}\n" + self._where()
        )

    def _where(self) -> str:
        text = f"You are in cell {self.position}."
        if self.opts.hint:
            text += f" The exit is to the {'left' if self.exit < self.position else 'right'}."
        return text

    def task_info(self) -> dict:
        return {"exit": self.exit}

    def anchor_observation(self) -> str:
        return self._where()

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(["left", "right"])

    def step(self, action: str) -> StepResult:
        self.turn += 1
        move = action.strip().lower()
        valid = move in ("left", "right")
        if not valid:
            prefix = f"Invalid action {action.strip()[:40]!r}: answer left or right. "
        else:
            target = self.position + (1 if move == "right" else -1)
            prefix = "You hit the wall. " if not 0 <= target < self.opts.length else ""
            self.position = min(max(target, 0), self.opts.length - 1)
        info = {"turn": self.turn, "position": self.position, "action_valid": valid}
        if self.position == self.exit:
            return StepResult(f"You reached the exit in cell {self.exit}.", 1.0, True, True, info)
        if self.turn >= self.max_turns:
            return StepResult(prefix + f"Out of moves. You are in cell {self.position}.", 0.0, True, False, info)
        return StepResult(prefix + self._where(), 0.0, False, False, info)
