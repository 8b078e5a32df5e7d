"""Batches for a model: the trajectories of concurrent Score calls (each a thread of the reward service) scored in
one forward pass, at most `max_batch` at a time, the first of them waiting at most `max_wait_s` for others."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Generic, TypeVar

X = TypeVar("X")
Y = TypeVar("Y")


class Batcher(Generic[X, Y]):
    def __init__(
        self,
        run: Callable[[list[X]], list[Y]],
        max_batch: int,
        max_wait_s: float,
        on_batch: Callable[[int, float], None] = lambda size, seconds: None,
    ):
        """`run` maps a list of inputs to their outputs in order; `on_batch(size, seconds)` hears of each run."""
        self.run, self.max_batch, self.max_wait_s, self.on_batch = run, max_batch, max_wait_s, on_batch
        self._requests: queue.SimpleQueue[tuple[list[X], Future]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._start = threading.Lock()

    def submit(self, items: Sequence[X], timeout_s: float | None = None) -> list[Y]:
        """The outputs of `items`, which may run together with other callers' items; what `run` raised, raised here
        in every caller of that batch."""
        if not items:
            return []
        done: Future = Future()
        self._ensure_worker()
        self._requests.put((list(items), done))
        return done.result(timeout_s)

    def _ensure_worker(self) -> None:
        with self._start:
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="reward-model-batcher", daemon=True)
                self._worker.start()

    def _serve(self) -> None:
        carried: tuple[list[X], Future] | None = None
        while True:
            first = carried or self._requests.get()
            batch, size, carried = [first], len(first[0]), None
            deadline = time.monotonic() + self.max_wait_s
            while size < self.max_batch:
                try:
                    request = self._requests.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if size + len(request[0]) > self.max_batch:
                    carried = request  # starts the next batch: a call's items are never split across two
                    break
                batch.append(request)
                size += len(request[0])
            self._run(batch, size)

    def _run(self, batch: list[tuple[list[X], Future]], size: int) -> None:
        items = [item for request, _ in batch for item in request]
        start = time.perf_counter()
        try:
            outputs = []
            for i in range(0, len(items), self.max_batch):  # one call larger than max_batch: in slices
                outputs += self.run(items[i : i + self.max_batch])
        except BaseException as exc:  # noqa: BLE001 - every caller of the batch hears of it; the worker goes on
            for _, done in batch:
                done.set_exception(exc)
            return
        finally:
            self.on_batch(size, time.perf_counter() - start)
        at = 0
        for request, done in batch:
            done.set_result(outputs[at : at + len(request)])
            at += len(request)
