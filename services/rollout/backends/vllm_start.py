"""How vLLM's engine core and worker processes start on the CPU: forked where that is safe.

vLLM's CPU platform spawns them so that its LD_PRELOAD of torch's libgomp takes effect in them; each spawned
process then imports vLLM again (11-16 s on a 2-core machine). Forked, a rollout server's engine was ready
in 19-23 s against 40-45 s spawned, generating as fast. A fork copies only the calling thread: a child
forked beside an OpenMP pool deadlocks on its first parallel region, one forked beside other threads may
inherit locks they held. So a process forks only while it has no other threads (the rollout server starts
its engine before its gRPC server, and its OpenMP pool holds one thread); a test runner, or a process that
already computed with several threads, spawns.
"""

from __future__ import annotations

import os
from pathlib import Path

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
FORK_SAFE_THREADS = frozenset({"jemalloc_bg_thd"})
"""Threads a fork may leave behind: jemalloc's fork hooks stop its background thread and the child starts its own."""


def other_threads() -> list[str]:
    """Names of this process's OS threads besides the main one (Python's and native ones: an OpenMP
    pool, gRPC, a test runner's); `["?"]` when /proc cannot tell."""
    try:
        tasks = [t for t in os.listdir("/proc/self/task") if int(t) != os.getpid()]
        return [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks]
    except (OSError, ValueError):
        return ["?"]


def cpu_start_method(on_cpu: bool, threads: list[str], requested: str = "") -> str | None:
    """How vLLM's engine core and worker processes start on the CPU: as `requested` (this process's
    VLLM_WORKER_MULTIPROC_METHOD) if set, else `fork` from a process whose only other threads are
    `FORK_SAFE_THREADS`, else vLLM's own choice (None: `spawn`)."""
    if not on_cpu:
        return None
    return requested or ("fork" if set(threads) <= FORK_SAFE_THREADS else None)
