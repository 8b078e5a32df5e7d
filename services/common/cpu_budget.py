"""How many cores this process may use, and how a local run splits them between its processes.

The budget is the smallest of the cgroup CPU quota (a container's CPU limit: cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us / cpu.cfs_period_us`), the CPUs of the affinity mask and `OMRL_CORES` where it is set (the share of
a machine that several runs side by side each plan for: two runs on two cores that each sized their learner for
both oversubscribed them, and a tiny model's learner step took 5-6 times as long). Libraries size their thread
pools by the CPUs they see, not by the quota, so every co-located process (or a pod with a 4-CPU limit on
a 64-core node) would start one thread per visible CPU; the sum oversubscribes the cores and the compute
threads stall on each other. A local run binds the vLLM CPU worker to its share of the cores; the learner
gets the other share when the two overlap (max_staleness >= 1), else every core but a spare one (they take
turns, and the idle side's threads soon sleep); the small services (env, reward, the rollout front and engine
core) get one thread each: they wait on the network, they do not compute.

Idle OpenMP threads spin briefly for the next parallel region, then sleep (`OPENMP_IDLE`): a pool that spins
on takes the core another process is about to compute on, and one that sleeps at once (OMP_WAIT_POLICY=PASSIVE)
pays a wake-up at every op, which a small model's many small ops cannot afford."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CORES_ENV = "OMRL_CORES"
"""Cores to plan for at most (an integer >= 1); read by `available_cores`."""
SPIN_ENV = "OMRL_VLLM_SPIN_S"
"""Read by `services.engines.vllm_idle` in vLLM's engine core and worker processes."""
ENGINE_SPIN_S = "0.005"
"""How long vLLM's CPU worker spins for the next message before it blocks (vLLM: 1 s); the launcher's own
environment overrides it."""
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM's list of the cores its CPU worker binds one OpenMP thread to each ("3", "2,3", "4-7")."""


def bind_cpus(bind: str) -> set[int]:
    """The CPUs a `VLLM_CPU_OMP_THREADS_BIND` list names ("1", "0,2", "4-7"); none for "auto", "nobind", several
    ranks ("0-3|4-7") or anything else vLLM decides itself."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", bind):
        return set()
    cpus: set[int] = set()
    for part in bind.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS")
OPENMP_IDLE = {"GOMP_SPINCOUNT": "10000"}
"""How long an idle OpenMP thread of torch's GNU runtime spins before it sleeps (libgomp's default: 300,000 spins;
OMP_WAIT_POLICY=PASSIVE: none). The tiny model's learner step on 2 threads (bench/learner_cpu.py, the 4x8 vs_trl
batch): 0.089-0.092 s with PASSIVE, 0.045-0.062 s with 3,000 to 300,000 spins (docs/benchmarks.md)."""


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (e.g. 1.5), None without a quota or cgroup files."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000" or "150000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # v1
        try:
            quota_us = int((root / folder / "cpu.cfs_quota_us").read_text())
            period_us = int((root / folder / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    return None


@dataclass(frozen=True)
class Cores:
    ids: tuple[int, ...]
    """CPU ids this process may run on (its affinity mask), in order."""
    count: int
    """Cores to plan for: the affinity size, capped by the cgroup quota (rounded down, at least 1)."""


def available_cores(root: Path = CGROUP_ROOT, affinity: set[int] | None = None) -> Cores:
    ids = tuple(sorted(os.sched_getaffinity(0) if affinity is None else affinity))
    count = len(ids)
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        count = min(count, math.floor(quota))
    share = os.environ.get(CORES_ENV, "").strip()
    if share:
        if not share.isdigit() or int(share) < 1:
            raise ValueError(f"{CORES_ENV}={share!r}: the cores to plan for must be an integer >= 1")
        count = min(count, int(share))
    return Cores(ids, max(1, count))


@dataclass(frozen=True)
class ThreadBudget:
    learner: int
    """Torch/OpenMP threads of each learner process."""
    engine_cpus: tuple[int, ...]
    """Cores the vLLM CPU worker binds its OpenMP threads to (one thread per core)."""
    service: int
    """Threads of each small service process."""


def split(
    cores: Cores,
    learner_procs: int = 1,
    learner: int = 0,
    engine: int = 0,
    service: int = 1,
    overlap: bool = True,
) -> ThreadBudget:
    """Shares `cores.count` cores: with 3 or more one stays free for the small services and vLLM's engine
    core, the rest goes half to the vLLM worker (the larger half) and half to the learner processes.
    Without `overlap` (a synchronous run: the engine has nothing to generate while the learner trains, and
    the learner waits while it generates) the learner processes share every core but the spare one; the
    idle side's threads sleep. `learner` and `engine` > 0 fix those shares (per learner process, worker)."""
    spare = 1 if cores.count >= 3 else 0
    compute = max(2, cores.count - spare)
    engine_threads = engine or math.ceil(compute / 2)
    learner_total = max(1, compute - engine_threads) if overlap else min(compute, cores.count)
    learner_threads = learner or max(1, learner_total // learner_procs)
    # the worker's cores: the last ones of the mask, so the learner's are the first ones when both fit
    engine_cpus = cores.ids[-engine_threads:] if engine_threads <= len(cores.ids) else cores.ids
    return ThreadBudget(learner_threads, tuple(engine_cpus), service)


def thread_env(threads: int) -> dict[str, str]:
    """Environment that sizes a process's OpenMP/BLAS pools; idle OpenMP threads spin briefly, then sleep."""
    env = {name: str(threads) for name in THREAD_VARS}
    env.update(OPENMP_IDLE)
    return env


def engine_env(budget: ThreadBudget) -> dict[str, str]:
    """The rollout process: one thread itself (its engine core inherits it), the vLLM CPU worker one
    OpenMP thread bound to each of its cores (vLLM sets the worker's OMP_NUM_THREADS from the list). A
    `VLLM_CPU_OMP_THREADS_BIND` in the launcher's own environment wins over the split's cores: two runs side by
    side on one machine (two test workers) would otherwise bind both workers to the same last core."""
    return {
        **thread_env(budget.service),
        BIND_ENV: os.environ.get(BIND_ENV) or ",".join(map(str, budget.engine_cpus)),
        SPIN_ENV: os.environ.get(SPIN_ENV, ENGINE_SPIN_S),
    }


def alone_engine_env(cores: Cores) -> dict[str, str]:
    """A rollout server alone in its container: the vLLM worker binds to every core of the budget but one,
    which the server's event loop and vLLM's engine core keep (vLLM's own default binds to every CPU of the
    affinity mask, however small the container's CPU limit)."""
    worker = max(1, cores.count - 1)
    return {
        **thread_env(1),
        BIND_ENV: ",".join(map(str, cores.ids[-worker:])),
        SPIN_ENV: ENGINE_SPIN_S,
    }


def torch_threads(configured: int = 0, root: Path = CGROUP_ROOT) -> int:
    """Threads a torch process uses: `configured` if set, else OMP_NUM_THREADS (a launcher's share), else
    every core of its budget (alone in its container)."""
    if configured:
        return configured
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return available_cores(root).count
