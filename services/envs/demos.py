"""Episodes of a random valid policy, played in process: the tiny model's tokenizer corpus and its format
warm-start. Every environment is closed once played. A task that cannot be played (a server that
rejects it, a reset that never answers, a server error) is skipped and the next index is tried, so one
bad task never ends a launch; a config that fails every task (a wrong option, a missing package, a
server that is down) still fails, after `max_failures` skips in a row.

Which tasks they play (`warmstart_tasks`, `corpus_tasks`):
- an env that makes each task from its index (the built-ins; `TextEnv.first_unseen_task`): warm-start plays
  indices no split reaches, from that first one on (a stride apart per seed), so it never plays an RL task;
  the tokenizer corpus reads tasks 0, 1, ..., the first of a generated train split.
- any other env (a task set of its own or of a server, e.g. AgentGym): both play the run's own train split,
  in file order, cycling. Those are the indices known to be served (an AgentGym server may hang on another:
  BabyAI did on 1000000234), never a validation task; a random policy's actions carry nothing about which
  action is right, and what warm-start reads there RL reads anyway."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from services.common.config import EnvConfig
from services.common.errors import ServiceError
from services.envs.base import StepResult, TaskRejected
from services.envs.messages import ToolResult

log = logging.getLogger(__name__)


@dataclass
class Demo:
    task_index: int
    observation: str
    """The first observation."""
    steps: list[tuple[str, StepResult]]
    """(action, what the env answered), in order."""


@dataclass
class DemoStats:
    played: int = 0
    skipped: Counter = field(default_factory=Counter)
    """Skipped tasks by reason: invalid, hung (TaskRejected) or the error class."""


MAX_PASSED_OVER = 100_000
"""Rejected tasks passed over in a row before giving up (a split of only rejected tasks would cycle forever)."""
SEED_STRIDE = 100_000
"""Warm-starts with different seeds play unseen tasks this far apart."""


def warmstart_tasks(env_cfg: EnvConfig, seed: int) -> Iterator[int]:
    """The tasks the format warm-start plays (see the module's docstring)."""
    from services.envs.registry import ENVS

    first = ENVS.get(env_cfg.name).first_unseen_task(dict(env_cfg.options))
    return run_tasks(env_cfg) if first is None else itertools.count(first + seed * SEED_STRIDE)


def corpus_tasks(env_cfg: EnvConfig) -> Iterator[int]:
    """The tasks the tokenizer corpus reads (see the module's docstring); reads no dataset for an env that
    makes each task from its index."""
    from services.envs.registry import ENVS

    first = ENVS.get(env_cfg.name).first_unseen_task(dict(env_cfg.options))
    return run_tasks(env_cfg) if first is None else itertools.count(0)


def run_tasks(env_cfg: EnvConfig) -> Iterator[int]:
    """The run's train split in file order, cycling (generated on first use, as the launcher does)."""
    from services.envs.datasets import TaskSplit

    return itertools.cycle(TaskSplit.load(env_cfg, "train").task_indices)


def task_indices(env_cfg: EnvConfig, first: int) -> Iterator[int]:
    """first, first + 1, ...; inside the env's task range where it has one (cycling through it)."""
    from services.envs.datasets import task_range

    tasks = task_range(env_cfg)
    i = 0
    while True:
        yield first + i if tasks is None else tasks[(first + i) % len(tasks)]
        i += 1


def random_episodes(
    env_cfg: EnvConfig,
    count: int,
    seed: int,
    first_task: int = 0,
    max_failures: int = 20,
    stats: DemoStats | None = None,
    say: Callable[[str], None] | None = None,
    tasks: Iterable[int] | None = None,
) -> Iterator[Demo]:
    """`count` episodes of the env's `random_action` policy, each at most `env_cfg.max_turns` turns, on `tasks`
    in order (default: `first_task` on, inside the env's task range)."""
    from services.envs.registry import ENVS

    rng, stats = random.Random(seed), stats if stats is not None else DemoStats()
    failures_in_a_row, rejected, passed_over = 0, set(), 0
    indices = iter(tasks) if tasks is not None else task_indices(env_cfg, first_task)
    while stats.played < count:
        task_index = next(indices)
        if task_index in rejected:  # said once: the tasks cycle, and a rejected one stays rejected
            passed_over += 1
            if passed_over > MAX_PASSED_OVER:
                raise RuntimeError(f"{env_cfg.name}: every task left is one the env rejected ({sorted(rejected)[:10]})")
            continue
        passed_over = 0
        env = ENVS.create(env_cfg.name)
        try:
            demo = Demo(task_index, env.reset(task_index, dict(env_cfg.options)), [])
            for _ in range(env_cfg.max_turns):
                action = env.random_action(rng)
                result = env.step(action)
                demo.steps.append((action, result))
                if result.done:
                    break
        except (TaskRejected, ServiceError) as exc:
            reason = exc.reason if isinstance(exc, TaskRejected) else type(exc).__name__
            if isinstance(exc, TaskRejected):
                rejected.add(task_index)
            stats.skipped[reason] += 1
            failures_in_a_row += 1
            message = f"{env_cfg.name}: task {task_index} skipped ({reason}): {exc}"
            (say or log.warning)(message)
            if failures_in_a_row >= max_failures:
                raise RuntimeError(f"{failures_in_a_row} tasks in a row failed; last: {message}") from exc
            continue
        finally:
            env.close()
        failures_in_a_row = 0
        stats.played += 1
        yield demo


@dataclass
class ToolTurn:
    calls: list[tuple[str, dict[str, Any]]]
    results: list[ToolResult]


@dataclass
class ToolDemo:
    task_index: int
    observation: str
    tools: list[dict[str, Any]]
    """The episode's function schemas, as the agent loop gives them to the template."""
    turns: list[ToolTurn | tuple[str, StepResult]]
    """Tool calls with their results, or an answer with what the env said, in order."""


def random_tool_episodes(
    env_cfg: EnvConfig, count: int, seed: int, tasks: Iterable[int], say: Callable[[str], None] | None = None
) -> list[ToolDemo]:
    """`count` episodes of a random tool user on `tasks`: each turn it makes the env's `random_tool_calls` (run by
    an in-process env service with the run's toolsets, as the tool-calling loop's would be), then answers with
    `random_answer` given what the tools returned. A task that fails is skipped, as `random_episodes` does."""
    return asyncio.run(_play_tool_demos(env_cfg, count, seed, iter(tasks), say))


async def _play_tool_demos(
    env_cfg: EnvConfig, count: int, seed: int, tasks: Iterator[int], say: Callable[[str], None] | None
) -> list[ToolDemo]:
    from services.envs.messages import ToolCall
    from services.envs.service import EnvService
    from services.envs.tool_host import ToolHost

    host = ToolHost(
        env_cfg.toolset_entries(),
        call_timeout_s=env_cfg.tool_timeout_s,
        max_calls=env_cfg.max_tool_calls,
    )
    service, rng, demos, failures = (
        EnvService(tools=host, step_timeout_s=env_cfg.step_timeout_s),
        random.Random(seed),
        [],
        0,
    )
    try:
        while len(demos) < count:
            task_index = next(tasks)
            try:
                state = await service.create(env_cfg.name, task_index, dict(env_cfg.options))
            except ServiceError as exc:
                failures += 1
                (say or log.warning)(f"{env_cfg.name}: task {task_index} skipped: {exc}")
                if failures >= 20:
                    raise RuntimeError(f"{failures} tasks failed in the tool warm-start; last: {exc}") from exc
                continue
            env, demo = service.env_of(state.episode_id), ToolDemo(task_index, state.observation, state.tools, [])
            try:
                for _ in range(env_cfg.max_turns):
                    seen: list[str] = []
                    calls = env.random_tool_calls(rng)[: env_cfg.max_tool_calls] if state.tools else []
                    if calls:
                        asked = [ToolCall(f"call_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)]
                        results = await service.call_tools(state.episode_id, asked)
                        demo.turns.append(ToolTurn(calls, results))
                        seen = [result.content for result in results]
                    answer = env.random_answer(rng, seen)
                    state = await service.step(state.episode_id, answer)
                    demo.turns.append((answer, StepResult(state.observation, state.reward, state.done, state.success)))
                    if state.done:
                        break
            finally:
                await service.close(state.episode_id)
            demos.append(demo)
    finally:
        await service.aclose()
    return demos
