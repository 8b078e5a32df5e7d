"""Maze: walk a square grid with walls from the start cell to the goal cell.

Each task is a `size` x `size` grid whose cells are walls with probability `wall_density`, resampled
from the task's seed until the goal is reachable; start and goal are at least two moves apart. The
turn limit is the shortest path plus `slack`, so the task is always solvable and wandering fails.
Every observation lists the open directions (`show_open`); with `hint` it also says how far the goal
is along each axis, and with `show_map` the first observation draws the grid.

Difficulty: `size` and `wall_density` (longer, more winding paths), `slack` (fewer spare moves),
`hint` off; easiest: `guide` names the next move of a shortest path. Reward 1 and success when the
agent steps onto the goal, else 0.
"""

from __future__ import annotations

import random
from collections import deque

from pydantic import Field

from services.envs.base import EnvOptions, StepResult, TextEnv, action_format
from services.envs.registry import register_env

MOVES = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
Cell = tuple[int, int]


class MazeOptions(EnvOptions):
    size: int = Field(5, ge=3, le=30)
    """Side of the square grid."""
    wall_density: float = Field(0.25, ge=0.0, le=0.6)
    """Probability that a cell is a wall."""
    slack: int = Field(2, ge=0, le=100)
    """Moves allowed beyond the shortest path."""
    hint: bool = True
    """Say how far the goal is along each axis in every observation."""
    show_map: bool = False
    """Draw the grid in the first observation."""
    show_open: bool = True
    """List the open directions in every observation (off: walls are found by bumping into them)."""
    guide: bool = False
    """Easiest level: every observation names the first move of a shortest path from here (a route
    guidance voice), so the task is following changing instructions, turn after turn."""


def shortest_path(walls: set[Cell], size: int, start: Cell, goal: Cell) -> list[str] | None:
    """The moves of one shortest path (BFS), or None when the goal is unreachable."""
    previous: dict[Cell, tuple[Cell, str]] = {}
    queue, seen = deque([start]), {start}
    while queue:
        cell = queue.popleft()
        if cell == goal:
            moves = []
            while cell != start:
                cell, move = previous[cell]
                moves.append(move)
            return moves[::-1]
        for move, (dr, dc) in MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if 0 <= nxt[0] < size and 0 <= nxt[1] < size and nxt not in walls and nxt not in seen:
                seen.add(nxt)
                previous[nxt] = (cell, move)
                queue.append(nxt)
    return None


def generate(seed: int, size: int, wall_density: float) -> tuple[set[Cell], Cell, Cell, int]:
    rng = random.Random(f"maze:{seed}")
    cells = [(r, c) for r in range(size) for c in range(size)]
    while True:
        start, goal = rng.sample(cells, 2)
        walls = {cell for cell in cells if cell not in (start, goal) and rng.random() < wall_density}
        path = shortest_path(walls, size, start, goal)
        if path is not None and len(path) >= 2:
            return walls, start, goal, len(path)


@register_env("maze")
class Maze(TextEnv):
    description = "Find the way through a grid maze to the goal."
    max_turns = 12
    runs_inline = True
    Options = MazeOptions

    def reset(self, task_index: int, options: dict) -> str:
        self.opts = opts = self.parse_options(options)
        self.walls, self.position, self.goal, self.optimal = generate(task_index, opts.size, opts.wall_density)
        self.max_turns, self.turn = self.optimal + opts.slack, 0
        text = (
            f"You are in a {opts.size}x{opts.size} maze (row 0 is the top, column 0 the left) and must reach "
            f"the goal at row {self.goal[0]}, column {self.goal[1]} within {self.max_turns} moves. Each turn, "
            f"move up, down, left or right. {action_format('up')}\n"
        )
        if opts.show_map:
            text += self.render() + "\n"
        return text + self._where()

    def render(self) -> str:
        """# wall, . open, A agent, G goal."""
        marks = {self.position: "A", self.goal: "G"}
        return "\n".join(
            "".join(marks.get((r, c), "#" if (r, c) in self.walls else ".") for c in range(self.opts.size))
            for r in range(self.opts.size)
        )

    def open_moves(self) -> list[str]:
        size, (r, c) = self.opts.size, self.position
        return [
            m
            for m, (dr, dc) in MOVES.items()
            if 0 <= r + dr < size and 0 <= c + dc < size and (r + dr, c + dc) not in self.walls
        ]

    def _where(self) -> str:
        text = f"You are at row {self.position[0]}, column {self.position[1]}."
        if self.opts.show_open:
            text += f" Open: {', '.join(self.open_moves())}."
        if self.opts.hint:
            dr, dc = self.goal[0] - self.position[0], self.goal[1] - self.position[1]
            parts = [f"{abs(dr)} {'down' if dr > 0 else 'up'}"] if dr else []
            parts += [f"{abs(dc)} {'right' if dc > 0 else 'left'}"] if dc else []
            text += f" The goal is {' and '.join(parts)}."
        if self.opts.guide:
            text += f" Next move: {shortest_path(self.walls, self.opts.size, self.position, self.goal)[0]}."
        return text

    def task_info(self) -> dict:
        return {"goal": list(self.goal), "shortest_path": self.optimal}

    def anchor_observation(self) -> str:
        return self._where()

    def random_action(self, rng: random.Random) -> str:
        return rng.choice(list(MOVES))

    def step(self, action: str) -> StepResult:
        self.turn += 1
        move = action.strip().lower().removeprefix("move ").strip()
        valid = move in MOVES
        if not valid:
            prefix = f"Invalid action {action.strip()[:40]!r}: answer up, down, left or right. "
        elif move in self.open_moves():
            dr, dc = MOVES[move]
            self.position, prefix = (self.position[0] + dr, self.position[1] + dc), ""
        else:
            prefix = "You bump into a wall. "
        info = {"turn": self.turn, "position": list(self.position), "action_valid": valid}
        if self.position == self.goal:
            return StepResult(f"You reached the goal in {self.turn} moves.", 1.0, True, True, info)
        if self.turn >= self.max_turns:
            return StepResult(prefix + "Out of moves.", 0.0, True, False, info)
        return StepResult(prefix + self._where(), 0.0, False, False, info)
