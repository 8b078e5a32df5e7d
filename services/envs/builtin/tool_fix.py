"""Tool fix: a settings file in the episode's workspace holds one wrong value ("Set timeout in config.ini to 45"),
and the task is to change that value, and nothing else, with the editor tool.

Success is read from the file when the agent answers (any answer ends the episode): the key's line must hold
the requested value (spaces around `=` are free) and every other line must be as written, so the model has to
call the editor with a correct edit; no answer text can do it. A model without tools has no way to touch the
file. `reset` computes the task without a workspace (datasets are written that way) and writes the file when
the env service has set one; `step` needs it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from pydantic import Field

from services.envs.base import EnvOptions, InvalidTask, StepResult, TextEnv, action_format
from services.envs.registry import register_env

MAX_FILE_BYTES = 1 << 20


def _ints(low: int, high: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randint(low, high))


def _words(*words: str) -> Callable[[random.Random], str]:
    return lambda rng: rng.choice(words)


SETTINGS: dict[str, Callable[[random.Random], str]] = {
    "timeout": _ints(5, 120),
    "port": _ints(1024, 65535),
    "retries": _ints(0, 10),
    "workers": _ints(1, 64),
    "max_connections": _ints(10, 1000),
    "cache_size_mb": _ints(16, 4096),
    "poll_interval": _ints(1, 300),
    "buffer_kb": _ints(4, 1024),
    "log_level": _words("debug", "info", "warning", "error"),
    "host": _words("localhost", "127.0.0.1", "0.0.0.0", "example.internal"),
    "compression": _words("on", "off"),
    "mode": _words("fast", "safe", "balanced"),
}
FILES = ("config.ini", "settings.ini", "app.conf", "service.cfg")
SECTIONS = ("server", "app", "database", "worker")


class ToolFixOptions(EnvOptions):
    settings: int = Field(5, ge=2, le=len(SETTINGS))
    """Lines of `key = value` in the file."""
    seed: int = Field(0, ge=0)
    """Another seed gives other tasks for the same indices."""
    max_turns: int = Field(4, ge=1, le=100)
    """Turns for tool calls and the final answer."""


@register_env("tool_fix")
class ToolFix(TextEnv):
    description = "Change one value in a settings file with the editor tool, leaving the rest as it is."
    max_turns = 4
    Options = ToolFixOptions
    tools = {"editor": {"type": "editor"}}

    def reset(self, task_index: int, options: dict) -> str:
        opts = self.parse_options(options)
        if task_index < 0:
            raise InvalidTask(f"task_index must be >= 0, got {task_index}")
        self.max_turns = opts.max_turns
        rng = random.Random(f"{opts.seed}:{task_index}")
        self.file = rng.choice(FILES)
        keys = rng.sample(sorted(SETTINGS), opts.settings)
        values = [SETTINGS[key](rng) for key in keys]
        self.line_index = rng.randrange(len(keys))
        self.key = keys[self.line_index]
        self.value = values[self.line_index]
        while self.value == values[self.line_index]:
            self.value = SETTINGS[self.key](rng)
        self.lines = [f"[{rng.choice(SECTIONS)}]"] + [f"{key} = {value}" for key, value in zip(keys, values)]
        self.line_index += 1
        if self.workspace is not None:
            self.workspace.mkdir(parents=True, exist_ok=True)
            (self.workspace / self.file).write_text("\n".join(self.lines) + "\n")
        return (
            f"The file {self.file} in your workspace holds settings as `key = value` lines, and one is wrong. "
            f"Set {self.key} in {self.file} to {self.value} and change nothing else. You can view and edit files "
            f"with the editor tool. When the file is fixed, answer done. {action_format('done')}"
        )

    def task_info(self) -> dict:
        return {"file": self.file, "key": self.key, "value": self.value}

    def random_action(self, rng: random.Random) -> str:
        return "done"

    def random_tool_calls(self, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        calls: list[tuple[str, dict[str, Any]]] = [("editor", {"command": "view", "path": self.file})]
        if rng.random() < 0.5:
            old = self.lines[self.line_index]
            new = f"{self.key} = {SETTINGS[self.key](rng)}"
            calls.append(("editor", {"command": "str_replace", "path": self.file, "old_str": old, "new_str": new}))
        return calls

    def _fixed(self) -> tuple[bool, str]:
        """Whether the file holds the requested value and nothing else changed, and what is wrong where not."""
        path = self.workspace / self.file
        if path.is_symlink() or not path.is_file():
            return False, f"{self.file} is missing."
        if path.stat().st_size > MAX_FILE_BYTES:
            return False, f"{self.file} is too large."
        lines = [line.rstrip() for line in path.read_text(errors="replace").splitlines()]
        while lines and not lines[-1]:
            lines.pop()
        if len(lines) != len(self.lines):
            return False, f"{self.file} has {len(lines)} lines instead of {len(self.lines)}."
        target = re.compile(rf"\s*{re.escape(self.key)}\s*=\s*{re.escape(self.value)}")
        if not target.fullmatch(lines[self.line_index]):
            return False, f"{self.key} is not set to {self.value}."
        if any(line != want for i, (line, want) in enumerate(zip(lines, self.lines)) if i != self.line_index):
            return False, f"Other lines of {self.file} changed."
        return True, f"{self.key} is set to {self.value}."

    def step(self, action: str) -> StepResult:
        if self.workspace is None:
            raise InvalidTask(
                f"{self.name} needs a workspace: play it in the tool-calling loop, whose env service gives one"
            )
        fixed, why = self._fixed()
        info = {"action_valid": True, "fixed": fixed}
        return StepResult(("Correct: " if fixed else "Not fixed: ") + why, 1.0 if fixed else 0.0, True, fixed, info)
