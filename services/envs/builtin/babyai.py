"""BabyAI grid-world instructions (the `minigrid` package's BabyAI levels), rendered as text.

Each observation gives the mission, what the agent sees in its 7x7 view (objects with their position
relative to the agent: steps ahead and steps to the side), what is right in front of it, what it
carries, and the actions. Task i is the level reset with seed i. Reward is minigrid's: 1 - 0.9 *
(steps / level step limit) when the mission is completed, else 0; success means completed.

Difficulty: `level`, any of minigrid's 96 BabyAI level ids, from `BabyAI-GoToRedBallNoDists-v0` (one
ball, no distractors) through `GoToLocal`, `PickupLoc`, `Open`, `PutNextLocal` to `BossLevel`;
`max_turns` caps the level's own step limit.
Needs the optional extra: `pip install -e ".[envs]"` (scripts/setup.sh installs it).
"""

from __future__ import annotations

import os
import random
from typing import Any

from pydantic import Field

from services.envs.base import EnvOptions, InvalidTask, MissingDependency, StepResult, TextEnv, action_format
from services.envs.registry import register_env

MISSING = 'the babyai env needs the `minigrid` package: pip install -e ".[envs]" (scripts/setup.sh installs it)'
ACTIONS = {
    "turn left": "left",
    "turn right": "right",
    "go forward": "forward",
    "pick up": "pickup",
    "drop": "drop",
    "toggle": "toggle",
}
ALIASES = {
    "left": "turn left",
    "right": "turn right",
    "forward": "go forward",
    "move forward": "go forward",
    "pickup": "pick up",
    "open": "toggle",
}
DOOR_STATES = {0: "open", 1: "closed", 2: "locked"}


class BabyAIOptions(EnvOptions):
    level: str = "BabyAI-GoToRedBallNoDists-v0"
    """A minigrid BabyAI level id (the `BabyAI-` prefix and `-v0` suffix may be left out)."""
    max_turns: int | None = Field(None, ge=1, le=10000)
    """Turn limit; default min(the level's step limit, 64)."""


def _minigrid():
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    try:
        import gymnasium
        import minigrid  # registers the BabyAI levels with gymnasium
    except ImportError:
        raise MissingDependency(MISSING) from None
    return gymnasium, minigrid


def level_id(level: str) -> str:
    gymnasium, _ = _minigrid()
    for candidate in (level, f"BabyAI-{level}", f"BabyAI-{level}-v0", f"{level}-v0"):
        if candidate.startswith("BabyAI-") and candidate in gymnasium.registry:
            return candidate
    known = sorted(k for k in gymnasium.registry if k.startswith("BabyAI-"))
    raise InvalidTask(f"unknown BabyAI level {level!r}; known: {', '.join(known)}")


def _side(n: int) -> str:
    return f"{abs(n)} step{'s' if abs(n) != 1 else ''} {'right' if n > 0 else 'left'}"


def describe(env: Any, image: Any) -> list[str]:
    """Objects in the agent's view, relative to it (the agent sits at the bottom middle, facing up)."""
    from minigrid.core.constants import IDX_TO_COLOR, IDX_TO_OBJECT

    size, seen = image.shape[0], []
    middle, row = size // 2, size - 1
    for j in range(size):
        for i in range(size):
            kind = IDX_TO_OBJECT[int(image[i, j, 0])]
            if kind in ("unseen", "empty", "wall", "floor", "agent") or (i, j) == (middle, row):
                continue
            color = IDX_TO_COLOR[int(image[i, j, 1])]
            name = f"{DOOR_STATES.get(int(image[i, j, 2]), '')} {color} door" if kind == "door" else f"{color} {kind}"
            ahead, side = row - j, i - middle
            where = [f"{ahead} step{'s' if ahead != 1 else ''} ahead"] if ahead else []
            where += [_side(side)] if side else []
            seen.append(f"a {name.strip()} {' and '.join(where) or 'here'}")
    return seen


@register_env("babyai")
class BabyAI(TextEnv):
    description = "BabyAI grid-world instructions (minigrid), rendered as text."
    max_turns = 64
    Options = BabyAIOptions

    def reset(self, task_index: int, options: dict) -> str:
        gymnasium, _ = _minigrid()
        opts = self.parse_options(options)
        self.env = gymnasium.make(level_id(opts.level))
        obs, _ = self.env.reset(seed=task_index)
        self.mission = obs["mission"]
        self.max_turns = min(opts.max_turns or 64, self.env.unwrapped.max_steps)
        self.turn = 0
        return (
            f"You are an agent in a grid world. Mission: {self.mission}. Each turn, answer one of: "
            f"{', '.join(ACTIONS)}. {action_format('go forward')}\n{self._render(obs)}"
        )

    def _render(self, obs: dict) -> str:
        env = self.env.unwrapped
        seen = describe(env, obs["image"])
        front = env.grid.get(*env.front_pos)
        front_text = (
            "nothing (open floor)"
            if front is None
            else ("a wall" if front.type == "wall" else f"a {front.color} {front.type}")
        )
        carrying = f"a {env.carrying.color} {env.carrying.type}" if env.carrying else "nothing"
        return (
            f"You see: {'; '.join(seen) if seen else 'no objects'}. Right in front of you: {front_text}. "
            f"You carry {carrying}."
        )

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(list(ACTIONS))

    def step(self, action: str) -> StepResult:
        self.turn += 1
        name = " ".join(action.lower().split())
        name = ALIASES.get(name, name)
        info: dict[str, Any] = {"turn": self.turn, "action_valid": name in ACTIONS}
        if name in ACTIONS:
            act = self.env.unwrapped.actions[ACTIONS[name]]
            obs, reward, terminated, truncated, _ = self.env.step(act)
            success = bool(terminated and reward > 0)
            if terminated or truncated or self.turn >= self.max_turns:
                verdict = "Mission complete!" if success else "The episode is over; the mission was not completed."
                return StepResult(f"{verdict} {self._render(obs)}", float(reward), True, success, info)
            return StepResult(self._render(obs), 0.0, False, False, info)
        text = f"Invalid action {action.strip()[:40]!r}: answer one of {', '.join(ACTIONS)}."
        if self.turn >= self.max_turns:
            return StepResult(f"{text} Out of turns.", 0.0, True, False, info)
        return StepResult(text, 0.0, False, False, info)

    def close(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
