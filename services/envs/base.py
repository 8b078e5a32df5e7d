"""The text-environment interface. The agent answers with `<action>...</action>`; an env only ever
receives the inner text, and says so (with the exact action format) in its first observation."""

from __future__ import annotations

import abc
import contextlib
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

UNSEEN_TASKS_FROM = 10**9
"""Above every generated split (env.train_tasks and env.validation_tasks are at most 100_000_000 and 100_000)."""


class InvalidTask(ValueError):
    """A task index or options the env cannot serve (the service answers INVALID_ARGUMENT)."""


class MissingDependency(InvalidTask):
    """The env needs a package that is not installed (the message says how to install it)."""


class TaskRejected(InvalidTask):
    """This task cannot be played here (its index is outside what the server serves, or its reset
    never answers): retrying it cannot help, so the episode's group is dropped and the task replaced.
    `reason` labels the abandoned-task counter: "invalid" or "hung"."""

    def __init__(self, message: str, reason: str = "invalid"):
        super().__init__(message)
        self.reason = reason


ABANDONED = re.compile(r"task abandoned \((\w+)\)")
"""How an abandoned task is named in an error's text, across the env service's gRPC answer and the rollout's
wrapping of it (services.rollout.producer quarantines the task)."""


def abandoned_text(exc: TaskRejected) -> str:
    return f"task abandoned ({exc.reason}): {exc}"


def abandoned_reason(text: str) -> str | None:
    """ "hung" or "invalid" where `text` tells of an abandoned task, else None."""
    found = ABANDONED.search(text)
    return found.group(1) if found else None


class EnvOptions(BaseModel):
    """Per-env knobs; subclasses add fields. Unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class StepResult:
    observation: str
    reward: float = 0.0
    done: bool = False
    success: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class TextEnv(abc.ABC):
    """One episode at a time; the service creates one instance per episode and calls it from one
    thread at a time. Invalid actions never raise: they get an observation saying what was wrong and
    count as a turn."""

    name: ClassVar[str] = "base"
    description: ClassVar[str] = ""
    max_turns: int = 1
    """Turn limit with default options (reported by ListEnvs); `reset` may change it per episode."""
    Options: ClassVar[type[EnvOptions]] = EnvOptions
    offline_prompts: ClassVar[bool] = True
    """False where `reset` needs a remote server, so datasets are written without prompts."""
    runs_inline: ClassVar[bool] = False
    """True where create, reset, step and close return at once (pure Python, no I/O, no waiting): the env
    service then calls them on its event loop, as a hop to a worker thread costs more than such a call.
    An env that does I/O or may block must leave it False, so that a slow call cannot stall the event loop
    and the call's deadline (`step_timeout_s`) still applies."""

    tools: ClassVar[dict[str, dict[str, Any]]] = {}
    """Toolsets this env's tasks are played with in the tool-calling agent loop, by instance name:
    {"type": <toolset type>, "options": {...}} (services.envs.tools). The run's `env.tools` add to them, and
    replace one of the same name."""
    workspace: Path | None = None
    """The episode's own folder where it has tools, set by the env service before `reset`: the files a task's
    tools work on (the editor's) live here; the service removes it when the episode closes."""

    @classmethod
    def tools_for(cls, options: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
        """The toolsets this env's tasks are played with under these options (default: `tools`)."""
        return dict(cls.tools)

    @classmethod
    def whole_words(cls, options: dict[str, Any] | None) -> list[str]:
        """Words that a tokenizer made for this env (the tiny model's) keeps as one token each: invented names an
        agent must copy exactly, which a 2-layer model misspells when they come in sub-word pieces."""
        return []

    @classmethod
    def task_range(cls, options: dict[str, Any] | None) -> range | None:
        """The task indices this env can serve with these options; None: any index >= 0."""
        return None

    @classmethod
    def first_unseen_task(cls, options: dict[str, Any] | None) -> int | None:
        """The first of the task indices that no generated split reaches and this env still serves: the format
        warm-start plays from here, so that it never plays an RL task. The default, for an env that makes each
        task from its index (local, no task range), is UNSEEN_TASKS_FROM. None for an env whose tasks are a set
        of its own or of a server, where an index outside the run's may not be served (an AgentGym BabyAI
        server hangs on some): warm-start plays the run's train split instead (services.envs.demos)."""
        if cls.offline_prompts and cls.task_range(options) is None:
            return UNSEEN_TASKS_FROM
        return None

    @classmethod
    def call_capacity(cls, options: dict[str, Any] | None) -> int | None:
        """Calls the env's backend serves at once with these options (the rest queue in the env service);
        None: no limit. The env-call deadlines scale with it (`services.envs.deadlines`)."""
        return None

    @classmethod
    def preflight(cls, options: dict[str, Any] | None) -> str | None:
        """Checks the env's backends (the servers it plays on) before a run starts, so that one that is down
        or of the wrong kind ends the launch at once: raises InvalidTask with one line naming what failed.
        Returns a short line saying what was checked, for the launcher to show; None (the default, an env
        with no backend): nothing to check."""
        return None

    @classmethod
    def parse_options(cls, options: dict[str, Any] | None) -> EnvOptions:
        try:
            return cls.Options.model_validate(options or {})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in exc.errors())
            raise InvalidTask(f"{cls.name}: bad options: {problems}") from None

    @abc.abstractmethod
    def reset(self, task_index: int, options: dict[str, Any]) -> str:
        """Starts task `task_index` (same index and options, same task) and returns the first observation."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult: ...

    def random_action(self, rng: random.Random) -> str:
        """A valid action drawn at random for the current state: the demonstrations of a format
        warm-start, which teach the action syntax and nothing about which action is right."""
        raise NotImplementedError(f"{self.name} has no random_action; the tiny-model warm-start needs one")

    def random_tool_calls(self, rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
        """Well-formed tool calls (tool name, arguments) for the current task, drawn at random: warm-start demos."""
        return []

    def random_answer(self, rng: random.Random, seen: list[str]) -> str:
        """The random tool user's final answer, once its calls returned `seen` (their outputs): a valid answer drawn
        at random. Default: `random_action`."""
        return self.random_action(rng)

    def task_info(self) -> dict[str, Any]:
        """What defines the current task's answer (dataset `reward_model.ground_truth`), e.g. {"answer": "7"}."""
        return {}

    def anchor_observation(self) -> str | None:
        """The current state as an observation without history (GiGPO's anchor state), asked after every
        reset and step: equal for equal states of one task, and free of what only the last action caused
        (an invalid-action note, a turn count). None: the last observation text is the anchor."""
        return None

    def episode_info(self) -> dict[str, Any]:
        """What the service returns as `info` from Create and Reset (where the episode runs, say)."""
        return {}

    def close(self) -> None:
        """Releases what the episode holds."""


_CALL = threading.local()


@contextlib.contextmanager
def call_deadline_at(deadline: float | None) -> Iterator[None]:
    """Runs an env call knowing when its caller gives up (time.monotonic()); set by the env service."""
    previous, _CALL.deadline = getattr(_CALL, "deadline", None), deadline
    try:
        yield
    finally:
        _CALL.deadline = previous


def call_time_left() -> float | None:
    """Seconds until the current env call's caller gives up; None outside the service (no deadline)."""
    deadline = getattr(_CALL, "deadline", None)
    return None if deadline is None else deadline - time.monotonic()


NUMBER = re.compile(r"-?\d[\d,]*")


def seen_number(rng: random.Random, seen: list[str], fallback: str) -> str:
    """A number drawn from those in `seen`, or `fallback`: an answer that copies a number the agent read, right or
    not (the warm-start's demos of a tool task thereby teach copying, and RL which number to copy)."""
    numbers = [n.replace(",", "") for text in seen for n in NUMBER.findall(text)]
    return rng.choice([*numbers, fallback])


def action_format(example: str) -> str:
    return f"Answer with exactly one action inside tags, for example <action>{example}</action>."
