"""The judge's engine: a generation backend (`RolloutBackend`; in service the rollout's own `VllmBackend`) driven by an
event loop of its own in a background thread, since vLLM's async engine must be driven from the loop it started in and
reward functions are sync code running in the reward service's worker threads.

Invariant: `generate_many` returns within its deadline plus `CANCEL_GRACE_S`, whatever the engine does; a request
still running at the deadline is cancelled (vLLM aborts it) and answered as a timeout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from services.engines.base import Generation, RolloutBackend, SamplingSpec

log = logging.getLogger(__name__)
T = TypeVar("T")

CANCEL_GRACE_S = 5.0
"""How long past a deadline a caller waits for the engine's loop to hand over what it has (a loop blocked by a
backend bug would otherwise hold the caller)."""


@dataclass
class Answer:
    generation: Generation | None
    failure: str = ""
    """Why there is no generation: "timeout" or "error"."""
    detail: str = ""
    seconds: float = 0.0


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, backend: RolloutBackend, timeout_s: float) -> None:
    """Shuts the backend down in its loop, then stops the loop; at most about `timeout_s`, and once."""
    if loop.is_closed():
        return
    if loop.is_running():
        try:
            asyncio.run_coroutine_threadsafe(backend.shutdown(), loop).result(timeout_s)
        except Exception as exc:  # noqa: BLE001 - shutting down: say so and go on stopping the loop
            log.warning("judge engine shutdown: %s: %s", type(exc).__name__, exc)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
    if not thread.is_alive():
        loop.close()


class JudgeEngine:
    """Starts `backend` in its own loop thread within `start_timeout_s` (else RuntimeError, the backend shut down
    and the loop stopped, as far as a start stuck in the loop lets them); at most `max_concurrency` requests run on
    it at once, the others wait for a slot."""

    def __init__(self, backend: RolloutBackend, *, max_concurrency: int, start_timeout_s: float, name: str = "judge"):
        self.backend, self.name = backend, name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-engine", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._slots: asyncio.Semaphore | None = None
        self._closer = weakref.finalize(self, _stop, self._loop, self._thread, backend, 30.0)
        start = asyncio.run_coroutine_threadsafe(self._start(max_concurrency), self._loop)
        try:
            start.result(start_timeout_s)
        except concurrent.futures.TimeoutError:
            start.cancel()
            self.close()
            raise RuntimeError(f"{name}: its engine did not start within {start_timeout_s:g}s") from None
        except BaseException:
            self.close()
            raise

    async def _start(self, max_concurrency: int) -> None:
        self._slots = asyncio.Semaphore(max_concurrency)
        await self.backend.start()

    def generate_many(self, prompts: list[list[int]], sampling: SamplingSpec, timeout_s: float) -> list[Answer]:
        """One Answer per prompt, in order, all run concurrently; those not done `timeout_s` after this call began
        are timeouts."""
        if not prompts:
            return []
        deadline = time.monotonic() + timeout_s
        run = asyncio.run_coroutine_threadsafe(self._answer_all(prompts, sampling, timeout_s), self._loop)
        try:
            return run.result(max(0.0, deadline - time.monotonic()) + CANCEL_GRACE_S)
        except concurrent.futures.TimeoutError:
            run.cancel()
            detail = f"the engine's loop did not answer within {timeout_s:g}s + {CANCEL_GRACE_S:g}s"
            return [Answer(None, "timeout", detail, timeout_s) for _ in prompts]

    async def _answer_all(self, prompts: list[list[int]], sampling: SamplingSpec, timeout_s: float) -> list[Answer]:
        started = time.perf_counter()
        tasks = [asyncio.ensure_future(self._answer(ids, sampling, started)) for ids in prompts]
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()  # vLLM aborts a request whose generate is cancelled
        late = Answer(None, "timeout", f"no verdict within {timeout_s:g}s", timeout_s)
        return [late if task in pending else task.result() for task in tasks]

    async def _answer(self, ids: list[int], sampling: SamplingSpec, started: float) -> Answer:
        assert self._slots is not None
        try:
            async with self._slots:
                generation = await self.backend.generate(f"{self.name}-{next(self._ids)}", ids, sampling)
        except Exception as exc:  # noqa: BLE001 - one request's failure is its answer, not the batch's
            return Answer(None, "error", f"{type(exc).__name__}: {exc}", time.perf_counter() - started)
        return Answer(generation, seconds=time.perf_counter() - started)

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Runs `coroutine` in the engine's loop, where the backend must be driven (a call on the backend itself)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Shuts the engine down and stops its loop (also at garbage collection or interpreter exit)."""
        self._closer.detach()
        _stop(self._loop, self._thread, self.backend, timeout_s)
