"""BabyAI grid-world instructions (the `minigrid` package's BabyAI levels), rendered as text.

Each observation gives the mission, what the agent sees in its 7x7 view (objects with their position
relative to the agent: steps ahead and steps to the side), what is right in front of it, what it
carries, and the actions. Task i is the level reset with seed i. Reward is minigrid's: 1 - 0.9 *
(steps / level step limit) when the mission is completed, else 0; success means completed.

Difficulty: `level`, any of minigrid's 96 BabyAI level ids, from `BabyAI-GoToRedBallNoDists-v0` (one
ball, no distractors) through `GoToLocal`, `PickupLoc`, `Open`, `PutNextLocal` to `BossLevel`;
`max_turns` caps the level's own step limit.

Options for learning with a small model (all off by default):
- `shaping` (0..1): potential-based reward shaping for GoTo missions. Each step's reward adds
  shaping * (d_before - d_after) / d_max, d the Manhattan distance from the cell in front of the agent
  to the nearest target object (0 exactly when the mission is complete, as a GoTo is complete when the
  agent faces its target), d_max the grid's width + height - 2. The shaped terms telescope, so an
  episode's total is shaping * (d_first - d_last) / d_max, and, being a difference of potentials, they
  keep the optimal policy (Ng, Harada & Russell 1999). Missions without one locatable target get 0.
  `success` stays the mission's completion; `info` reports `shaping` and `mission_reward` per step.
- `compact`: a shorter rendering of each observation (about half the tokens): the objects in view,
  what is in front, what is carried, in few words.
- `random_policy`: the policy of `random_action` (the tiny model's warm-start demonstrations):
  `uniform` over the six actions, or `moves`: go forward half the time, else turn left or right
  (the only actions a GoTo mission needs); it still knows nothing of where the target is.
Needs the optional extra: `pip install -e ".[envs]"` (scripts/setup.sh installs it).
"""

from __future__ import annotations

import os
import random
from typing import Any, Literal

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
    shaping: float = Field(0.0, ge=0, le=1)
    """Weight of the potential-based distance shaping added to each step's reward (GoTo missions)."""
    compact: bool = False
    """Shorter observations: fewer tokens per turn, so shorter contexts."""
    random_policy: Literal["uniform", "moves"] = "uniform"
    """`random_action`'s policy: uniform over the actions, or forward 1/2, turn left 1/4, turn right 1/4."""


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


def describe(env: Any, image: Any, compact: bool = False) -> list[str]:
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
            if compact:
                seen.append(f"{name.strip()} {_compact_place(ahead, side)}")
                continue
            where = [f"{ahead} step{'s' if ahead != 1 else ''} ahead"] if ahead else []
            where += [_side(side)] if side else []
            seen.append(f"a {name.strip()} {' and '.join(where) or 'here'}")
    return seen


def target_distance(env: Any) -> int | None:
    """Manhattan distance from the cell in front of the agent to the nearest target of a GoTo mission;
    None where the mission has no such target."""
    from minigrid.envs.babyai.core.verifier import GoToInstr

    instrs = getattr(env, "instrs", None)
    if not isinstance(instrs, GoToInstr) or not instrs.desc.obj_poss:
        return None
    fx, fy = env.front_pos
    return min(abs(int(fx) - int(x)) + abs(int(fy) - int(y)) for x, y in instrs.desc.obj_poss)


def _compact_place(ahead: int, side: int) -> str:
    parts = [f"{ahead} ahead"] if ahead else []
    parts += [f"{abs(side)} {'right' if side > 0 else 'left'}"] if side else []
    return " ".join(parts) or "here"


@register_env("babyai")
class BabyAI(TextEnv):
    description = "BabyAI grid-world instructions (minigrid), rendered as text."
    max_turns = 64
    Options = BabyAIOptions

    def reset(self, task_index: int, options: dict) -> str:
        gymnasium, _ = _minigrid()
        opts = self.parse_options(options)
        self.env = gymnasium.make(level_id(opts.level))
        self.opts = opts
        obs, _ = self.env.reset(seed=task_index)
        unwrapped = self.env.unwrapped
        self.d_max = unwrapped.width + unwrapped.height - 2
        self.distance = target_distance(unwrapped)
        self.mission = obs["mission"]
        self.max_turns = min(opts.max_turns or 64, self.env.unwrapped.max_steps)
        self.turn, self.view = 0, self._render(obs)
        return (
            f"You are an agent in a grid world. Mission: {self.mission}. Each turn, answer one of: "
            f"{', '.join(ACTIONS)}. {action_format('go forward')}\n{self.view}"
        )

    def anchor_observation(self) -> str:
        """The agent's view: an invalid action leaves it as it was."""
        return self.view

    def _render(self, obs: dict) -> str:
        env = self.env.unwrapped
        if self.opts.compact:
            return self._render_compact(obs)
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

    def _render_compact(self, obs: dict) -> str:
        env = self.env.unwrapped
        seen = describe(env, obs["image"], compact=True)
        front = env.grid.get(*env.front_pos)
        front_text = "floor" if front is None else ("wall" if front.type == "wall" else f"{front.color} {front.type}")
        carrying = f" Carry {env.carrying.color} {env.carrying.type}." if env.carrying else ""
        return f"See {', '.join(seen) if seen else 'nothing'}. Front {front_text}.{carrying}"

    def random_action(self, rng: random.Random) -> str:
        if getattr(self, "opts", None) is not None and self.opts.random_policy == "moves":
            return rng.choice(["go forward", "go forward", "turn left", "turn right"])
        return rng.choice(list(ACTIONS))

    def _shaping(self) -> float:
        """The potential difference of the step just taken (0 without shaping or a locatable target)."""
        if not self.opts.shaping or self.distance is None:
            return 0.0
        before, self.distance = self.distance, target_distance(self.env.unwrapped)
        return self.opts.shaping * (before - self.distance) / self.d_max

    def step(self, action: str) -> StepResult:
        self.turn += 1
        name = " ".join(action.lower().split())
        name = ALIASES.get(name, name)
        info: dict[str, Any] = {"turn": self.turn, "action_valid": name in ACTIONS}
        if name in ACTIONS:
            act = self.env.unwrapped.actions[ACTIONS[name]]
            obs, reward, terminated, truncated, _ = self.env.step(act)
            success = bool(terminated and reward > 0)
            shaped = self._shaping()
            info.update(mission_reward=float(reward), shaping=shaped)
            self.view = self._render(obs)
            if terminated or truncated or self.turn >= self.max_turns:
                verdict = "Mission complete!" if success else "The episode is over; the mission was not completed."
                return StepResult(f"{verdict} {self.view}", float(reward) + shaped, True, success, info)
            return StepResult(self.view, shaped, False, False, info)
        text = f"Invalid action {action.strip()[:40]!r}: answer one of {', '.join(ACTIONS)}."
        if self.turn >= self.max_turns:
            return StepResult(f"{text} Out of turns.", 0.0, True, False, info)
        return StepResult(text, 0.0, False, False, info)

    def close(self) -> None:
        env = getattr(self, "env", None)
        if env is not None:
            env.close()
