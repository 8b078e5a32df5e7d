"""Background tasks of the rollout server that must not die quietly: one that ends with an exception is
logged, recorded, and stops the server, which then exits non-zero so its launcher (or Kubernetes)
restarts it."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import threading
from collections.abc import Awaitable, Callable

import redis
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

log = logging.getLogger(__name__)


class TaskSupervisor:
    """`exit_deadline_s`: once a task fails, the process ends with exit 1 after that many seconds even if its
    shutdown has not returned (a library's cleanup beside a dead engine must not hold back the restart)."""

    def __init__(self, stop: asyncio.Event, exit_deadline_s: float | None = None):
        self.stop = stop
        self.failure: str | None = None
        self.exit_deadline_s = exit_deadline_s
        self._tasks: list[asyncio.Task] = []

    def start(self, name: str, coro: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        task.add_done_callback(self._finished)
        self._tasks.append(task)
        return task

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            if self.exit_deadline_s is not None:
                exit_after(self.exit_deadline_s, reason)
        self.stop.set()

    def _finished(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            log.info("%s finished", task.get_name())
            return
        log.error(
            "%s died: %s: %s; shutting down (exit 1) to be restarted",
            task.get_name(),
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        self.fail(f"{task.get_name()} died: {type(exc).__name__}: {exc}")

    async def cancel_all(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def exit_after(seconds: float, reason: str) -> threading.Timer:
    """Ends the process with exit 1 in `seconds` unless it has ended by then; logs every thread's stack first,
    so the cleanup that hung can be found."""

    def hard_exit() -> None:
        log.error("shutdown after %r still running after %gs; exiting 1 now. Thread stacks:", reason, seconds)
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    timer = threading.Timer(seconds, hard_exit)
    timer.daemon = True  # it must never itself hold the process up
    timer.start()
    return timer


TRANSIENT_REDIS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


async def retrying(
    call: Callable[[], Awaitable],
    what: str,
    every_s: float,
    max_backoff_s: float = 30.0,
    pause: Callable[[], Awaitable] | None = None,
) -> None:
    """Runs `call` every `every_s` forever (`pause`: after each call awaits that instead, which may end sooner); a
    transient Redis error is retried after 2, 4, 8, ... times `every_s` (at most `max_backoff_s`), anything else
    ends the loop (and, supervised, the server)."""

    def warn(state: RetryCallState) -> None:
        log.warning(
            "%s: Redis unavailable (%s); retrying in %.1fs", what, state.outcome.exception(), state.upcoming_sleep
        )

    while True:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(TRANSIENT_REDIS),
            before_sleep=warn,
            wait=wait_exponential(multiplier=2 * every_s, max=max_backoff_s),
        ):
            with attempt:
                await call()
        await (pause() if pause else asyncio.sleep(every_s))


async def watch_engine(
    check_alive: Callable[[], Awaitable], on_dead: Callable[[BaseException], None], every_s: float = 1.0
) -> None:
    while True:
        try:
            await check_alive()
        except Exception as exc:  # noqa: BLE001 - any failure of the health check means a dead engine
            on_dead(exc)
            return
        await asyncio.sleep(every_s)
