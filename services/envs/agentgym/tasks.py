"""What this process has learned about tasks of one server set: which answered a reset (proven), which cannot be
played (a reset or step that never answered, an index the server rejects). A task not proven yet is reset by one
episode at a time: a group's episodes all reset the same task at once, and a task that hangs would otherwise hold
one server worker thread per episode (BabyAI's 1000000234 took 96 of them in one run). The others wait for that
first reset; if it never answers they are rejected without calling the server, and so is every later episode of
the task. Across processes the rollout keeps the run's quarantine in Redis (services.rollout.producer)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from services.common.errors import DeadlineExceeded
from services.envs.base import TaskRejected


class TaskGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._proven: set[int] = set()
        self._rejected: dict[int, TaskRejected] = {}
        self._trying: set[int] = set()
        self._cut_short: dict[int, int] = {}
        self._step_hangs: dict[int, int] = {}

    def proven_task(self) -> int | None:
        """A task whose reset has answered (the first one), or None."""
        with self._cond:
            return min(self._proven) if self._proven else None

    @contextlib.contextmanager
    def first_reset(self, task: int, wait_s: float | None) -> Iterator[None]:
        """Lets the caller reset `task` once it is proven, or as its first trial; waits up to `wait_s` for a
        trial under way. Raises TaskRejected for a task rejected before, DeadlineExceeded when the wait ends."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        mine = False
        with self._cond:
            while True:
                if task in self._rejected:
                    first = self._rejected[task]
                    raise TaskRejected(f"{first} (remembered: not sent again)", first.reason)
                if task in self._proven:
                    break
                if task not in self._trying:
                    self._trying.add(task)
                    mine = True
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    exc = DeadlineExceeded(f"task {task}: its first reset, still under way, did not answer in time")
                    exc.full_wait = False  # as servers.no_reply: the wait was cut short, nothing is known of the task
                    raise exc
                self._cond.wait(left)
        try:
            yield
        finally:
            if mine:
                with self._cond:
                    self._trying.discard(task)
                    self._cond.notify_all()

    def proved(self, task: int) -> None:
        with self._cond:
            self._proven.add(task)
            self._cut_short.pop(task, None)
            self._cond.notify_all()

    def reject(self, task: int, exc: TaskRejected) -> None:
        with self._cond:
            self._rejected.setdefault(task, exc)
            self._proven.discard(task)
            self._cond.notify_all()

    def cut_short(self, task: int) -> int:
        """Counts a reset of this task that ran out of time after queueing; returns how many so far."""
        with self._cond:
            self._cut_short[task] = self._cut_short.get(task, 0) + 1
            return self._cut_short[task]

    def step_hung(self, task: int) -> int:
        """Counts a step of this task that got no reply in the full timeout_s; returns how many so far. A step
        hangs on an action as much as on a task, so one is not enough to give the task up."""
        with self._cond:
            self._step_hangs[task] = self._step_hangs.get(task, 0) + 1
            return self._step_hangs[task]

    def rejected(self) -> dict[int, str]:
        with self._cond:
            return {task: exc.reason for task, exc in self._rejected.items()}
