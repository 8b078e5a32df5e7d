"""The core that the vLLM CPU workers of one test process's engines and runs are bound to."""

import os

from services.common.cpu_budget import BIND_ENV


def engine_cpu(xdist_worker: str | None, cpus: list[int]) -> int:
    """The last CPU for a run alone or xdist's first worker (gw0), the one before it for the second, and so on: two
    workers' runs side by side each generate on a core of their own instead of both on the last one."""
    index = int(xdist_worker.removeprefix("gw")) if xdist_worker else 0
    return sorted(cpus)[-1 - index % len(cpus)]


def bind_engines_of_this_worker() -> int:
    """Sets `VLLM_CPU_OMP_THREADS_BIND` for every engine this test process starts (the local launcher and vLLM read
    it) to this xdist worker's core, unless the caller set it; returns the core it names first."""
    cpu = engine_cpu(os.environ.get("PYTEST_XDIST_WORKER"), list(os.sched_getaffinity(0)))
    bind = os.environ.setdefault(BIND_ENV, str(cpu))
    return int(bind.split(",")[0].split("-")[0])
