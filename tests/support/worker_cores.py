"""The cores of one test process (a pytest-xdist worker) and of what it starts: its vLLM engines' worker core and its
own torch threads."""

import os

from services.common.cpu_budget import BIND_ENV, CORES_ENV, available_cores, bind_cpus


def engine_cpu(xdist_worker: str | None, cpus: list[int]) -> int:
    """The last CPU for a run alone or xdist's first worker (gw0), the one before it for the second, and so on: two
    workers' runs side by side each generate on a core of their own instead of both on the last one."""
    index = int(xdist_worker.removeprefix("gw")) if xdist_worker else 0
    return sorted(cpus)[-1 - index % len(cpus)]


def bind_engines_of_this_worker() -> int:
    """Sets `VLLM_CPU_OMP_THREADS_BIND` for every engine this test process starts (the local launcher and vLLM read
    it) to this xdist worker's core, unless the caller set it; returns the lowest core it names."""
    cpu = engine_cpu(os.environ.get("PYTEST_XDIST_WORKER"), list(os.sched_getaffinity(0)))
    return min(bind_cpus(os.environ.setdefault(BIND_ENV, str(cpu))))


def torch_threads_share(cores: int, xdist_workers: int) -> int:
    """Torch threads for one of `xdist_workers` test processes sharing `cores`: an even share, at least one."""
    return max(1, cores // max(1, xdist_workers))


def share_torch_threads_among_workers() -> None:
    """Under pytest-xdist, this process's torch computes on its share of the cores. With torch's default (a thread per
    core) in every worker, a tiny model's many small parallel regions each wait at their barrier for a thread that
    another process holds off its core: beside a busy process, in-process torch tests ran 20-30 times slower (a
    5 s module took 140 s, the learning tests' model build 362 s against 17 s)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        import torch

        share = torch_threads_share(available_cores().count, int(workers))
        torch.set_num_threads(share)
        # and the runs it starts size their learners for that share (`available_cores`): two learning runs side by
        # side, each learner on both cores, took 8.6 s a GRPO update against 1.8 s
        os.environ.setdefault(CORES_ENV, str(share))
