"""How vLLM's engine core and worker processes start on the CPU: forked where that is safe.

vLLM's CPU platform spawns them so that its LD_PRELOAD of torch's libgomp takes effect in them; each spawned
process then imports vLLM again (11-16 s on a 2-core machine). Forked, a rollout server's engine was ready
in 19-23 s against 40-45 s spawned, generating as fast. A fork copies only the calling thread: a child
forked beside an OpenMP pool deadlocks on its first parallel region, one forked beside other threads may
inherit locks they held. So a process forks only while it has no other threads (the rollout server starts
its engine before its gRPC server, and its OpenMP pool holds one thread); a test runner, or a process that
already computed with several threads, spawns, as does a worker bound to several CPUs and any machine but
x86-64.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from services.common.cpu_budget import bind_cpus

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
FORKED_ENV = "OMRL_VLLM_FORKED"
"""Set for the engine's processes when they are forked (`bind_forked_worker` reads it in the worker)."""
FORK_MACHINES = frozenset({"x86_64"})
"""Where forked engine processes were run: vLLM's kernels there take OpenMP from torch's own libgomp either way."""
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


def bound_cpus(bind: str) -> int:
    """How many CPUs `VLLM_CPU_OMP_THREADS_BIND` gives the worker ("1", "0,2", "4-7"); 0 for "auto", "nobind",
    several ranks ("0-3|4-7") or anything else vLLM decides itself."""
    return len(bind_cpus(bind))


def cpu_start_method(
    on_cpu: bool, threads: list[str], requested: str = "", machine: str = "x86_64", bind: str = ""
) -> str | None:
    """How vLLM's engine core and worker processes start on the CPU: as `requested` (this process's
    VLLM_WORKER_MULTIPROC_METHOD) if set, else `fork` on x86-64, for a worker bound to one CPU (`bind`:
    VLLM_CPU_OMP_THREADS_BIND), from a process whose only other threads are `FORK_SAFE_THREADS`; else vLLM's
    own choice (None: `spawn`)."""
    if not on_cpu:
        return None
    if requested:
        return requested
    # vLLM pins each of the worker's OpenMP threads to its own CPU through the runtime's environment, which a
    # forked worker's runtime (loaded in this process) ignores; `bind_forked_worker` restores the pinning only
    # for one thread (a 2-thread worker forked and bound as a set generated ~10% slower). Elsewhere (AArch64)
    # vLLM preloads torch's libgomp for its binding, which a forked worker would not get; not run here.
    one_cpu = bound_cpus(bind) == 1
    return "fork" if machine in FORK_MACHINES and one_cpu and set(threads) <= FORK_SAFE_THREADS else None


def worker_cpus(env: dict[str, str]) -> set[int]:
    """The CPUs vLLM binds its worker's OpenMP threads to (`GOMP_CPU_AFFINITY` "0 1", or `OMP_PLACES` "{0,1}")."""
    listed = env.get("GOMP_CPU_AFFINITY") or env.get("OMP_PLACES") or ""
    return {int(cpu) for cpu in re.findall(r"\d+", listed)}


def bind_forked_worker() -> None:
    """In a forked worker: what vLLM's CPU thread binding would have done in a spawned one.

    vLLM binds the worker through the OpenMP runtime's environment (OMP_NUM_THREADS and GOMP_CPU_AFFINITY, set
    before it starts the worker), which the runtime reads when it loads; a forked worker's runtime loaded in the
    rollout server and ignores them (a worker bound to 2 CPUs then ran one thread, 30% slower). So: torch's
    thread count, and the bound CPUs as the affinity that the OpenMP threads, made after this, inherit (for one
    CPU, vLLM's own pinning). Runs before the worker's first parallel region: its parent never ran one on
    several threads."""
    if os.environ.get(FORKED_ENV) != "1":
        return
    import torch

    cpus = worker_cpus(dict(os.environ))
    if cpus:
        os.sched_setaffinity(0, cpus)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
