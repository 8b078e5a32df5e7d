"""Episodes of a random valid policy, played in process: the tiny model's tokenizer corpus and its format
warm-start. Every environment is closed once played. A task that cannot be played (a server that
rejects it, a reset that never answers, a server error) is skipped and the next index is tried, so one
bad task never ends a launch; a config that fails every task (a wrong option, a missing package, a
server that is down) still fails, after `max_failures` skips in a row."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from services.common.config import EnvConfig
from services.common.errors import ServiceError
from services.envs.base import StepResult, TaskRejected

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
) -> Iterator[Demo]:
    """`count` episodes of the env's `random_action` policy, each at most `env_cfg.max_turns` turns."""
    from services.envs.registry import ENVS

    rng, stats = random.Random(seed), stats if stats is not None else DemoStats()
    failures_in_a_row, indices = 0, task_indices(env_cfg, first_task)
    while stats.played < count:
        task_index = next(indices)
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
