"""The reconcile loop, supervised: `recover` once, then a `tick` every interval. A pass that raises is logged
and the next one runs; anything that ends the loop itself restarts it (recover again) after a back-off
that doubles up to a cap. `health` is what /readyz reports: the loop runs and finished a pass recently."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services.jobs.manager import JobManager

log = logging.getLogger(__name__)


class Reconciler:
    def __init__(
        self,
        manager: JobManager,
        interval_s: float,
        max_pass_age_s: float,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.manager, self.interval_s, self.max_pass_age_s = manager, interval_s, max_pass_age_s
        self.backoff_s, self.max_backoff_s, self.clock = backoff_s, max_backoff_s, clock
        self.restarts = 0
        self.last_pass: float | None = None
        self.last_error: str | None = None
        self.running = False
        self.crashed = False
        """Set by a crash, cleared by the next good pass: a restarted loop is ready once it has done one."""
        self._started = clock()

    async def supervise(self, stop: asyncio.Event) -> None:
        delay = self.backoff_s
        while not stop.is_set():
            self.running = True
            try:
                await self._loop(stop)
                return
            except Exception as exc:
                self.crashed, self.last_error = True, f"reconcile loop crashed: {type(exc).__name__}: {exc}"
                log.exception("reconcile loop crashed; restarting in %.1fs", delay)
            finally:
                self.running = False
            self.restarts += 1
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, self.max_backoff_s)

    async def _loop(self, stop: asyncio.Event) -> None:
        await asyncio.to_thread(self.manager.recover)
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.manager.tick)
                self.last_pass, self.last_error, self.crashed = self.clock(), None, False
            except Exception as exc:
                self.last_error = f"reconcile pass failed: {type(exc).__name__}: {exc}"
                log.exception("reconcile pass failed")
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    def health(self) -> tuple[bool, str]:
        """(ready, why not): not ready before the first good pass (job recovery), while the loop is down, or when
        its last good pass is too old."""
        if not self.running or self.crashed:
            return False, self.last_error or "reconcile loop not running"
        if self.last_pass is None:  # until then, records of jobs that ran across a restart are stale
            return (
                False,
                f"recovering jobs: first reconcile pass not finished after {self.clock() - self._started:.0f}s"
                + (f" ({self.last_error})" if self.last_error else ""),
            )
        age = self.clock() - self.last_pass
        if age > self.max_pass_age_s:
            return False, f"no reconcile pass finished for {age:.0f}s" + (
                f" ({self.last_error})" if self.last_error else ""
            )
        return True, "ok"
