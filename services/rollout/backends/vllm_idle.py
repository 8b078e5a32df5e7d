"""Shortens vLLM's busy-wait between engine steps (vLLM 0.32 has no setting for it).

The shared-memory message queue between vLLM's engine core and its CPU worker (`shm_broadcast.SpinCondition`)
keeps a reader spinning on `sched_yield` for 1 s after each read before it blocks on its zmq notification
socket. During decoding that saves a wake-up per step; after the last step it burns a core for a second,
on both sides (the worker waits for the next schedule, the engine core for the worker's output), which on
a shared machine is the learner's core. Readers made after `shorten_spin` spin at most `SPIN_ENV` seconds.

It runs in the engine core and worker processes: they are spawned, and a spawned child imports its parent's
main module (`services.rollout.__main__` as `__mp_main__`), which calls `shorten_spin_from_env`."""

from __future__ import annotations

import os

from services.common.cpu_budget import SPIN_ENV


def shorten_spin(seconds: float) -> None:
    from vllm.distributed.device_communicators import shm_broadcast

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
