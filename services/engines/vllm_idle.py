"""Shortens vLLM's busy-wait between engine steps (vLLM 0.32 has no setting for it).

The shared-memory message queue between vLLM's engine core and its CPU worker (`shm_broadcast.SpinCondition`)
keeps a reader spinning on `sched_yield` for 1 s after each read before it blocks on its zmq notification
socket. During decoding that saves a wake-up per step; after the last step of a generation the worker,
waiting for the next schedule, burns a core for a second: on a shared machine, the core the learner is
about to train on. Readers made after `shorten_spin` spin at most that long.

A reader that has stopped spinning waits for the writer's zmq notification, and re-reads the queue's flag only
every `SHM_READER_RECHECK_INTERVAL_MS` (5 s in vLLM 0.32) if the notification is lost. Lost ones happen: in the
one-turn corridor bench, 1-2 steps in 3 of 4 runs took 5.1-5.4 s instead of 0.3 s, every generate call of the step
waiting 5.13-5.15 s (bench/vs_trl.py, issue 39). So the reader that stops spinning early also re-reads every
RECHECK_MS: a lost notification costs that long, and an idle worker wakes 50 times a second to read one flag.

It runs in the worker: vLLM imports the worker extension (`vllm_worker_ext`), which calls
`shorten_spin_from_env`, before it makes the worker's queues. The engine core's reader (it waits for the
worker's output while a step computes) keeps vLLM's 1 s: nothing of ours runs in that process before its
queues exist, and it only spins while a generation is in progress, not after.
"""

from __future__ import annotations

import logging
import os

from services.common.cpu_budget import SPIN_ENV

log = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: the worker has no other handler


RECHECK_MS = 20
"""How often an idle reader re-reads the queue's flag (vLLM 0.32: every 5 s)."""


def shorten_spin(seconds: float) -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    if hasattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):  # read at each wait, so a new value applies at once
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS, RECHECK_MS)

    original = shm_broadcast.SpinCondition.__init__
    if getattr(original, "omrl_spin_s", None) is not None:
        original = original.omrl_original

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = min(self.busy_loop_s, seconds)

    init.omrl_spin_s, init.omrl_original = seconds, original
    shm_broadcast.SpinCondition.__init__ = init


def shorten_spin_from_env() -> None:
    raw = os.environ.get(SPIN_ENV, "")
    if raw:
        shorten_spin(float(raw))
        log.info(
            "message-queue readers spin at most %ss before they block (vLLM: 1 s), then re-read every %d ms",
            raw,
            RECHECK_MS,
        )
