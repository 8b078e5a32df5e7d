"""vLLM's engine processes are forked on the CPU only from a process with no other threads."""

import os
import subprocess
import sys
import threading

from services.engines.vllm_start import (
    FORK_SAFE_THREADS,
    bound_cpus,
    cpu_start_method,
    other_threads,
    worker_cpus,
)


def test_a_single_threaded_process_whose_worker_has_one_cpu_forks():
    assert cpu_start_method(True, [], bind="1") == "fork"
    assert cpu_start_method(True, sorted(FORK_SAFE_THREADS), bind="3") == "fork"


def test_any_other_thread_or_an_unreadable_list_leaves_vllms_spawn():
    assert cpu_start_method(True, ["python"], bind="1") is None
    assert cpu_start_method(True, ["jemalloc_bg_thd", "grpc_global_tim"], bind="1") is None
    assert cpu_start_method(True, ["?"], bind="1") is None


def test_a_worker_on_several_cpus_or_vllms_own_binding_spawns():
    for bind in ("0,1", "2-3", "0-3|4-7", "auto", "nobind", ""):
        assert cpu_start_method(True, [], bind=bind) is None, bind


def test_an_explicit_setting_wins_and_a_gpu_or_another_machine_keeps_vllms_choice():
    assert cpu_start_method(True, [], requested="spawn", bind="1") == "spawn"
    assert cpu_start_method(True, ["python"], requested="fork") == "fork"
    assert cpu_start_method(False, [], bind="1") is None
    assert cpu_start_method(True, [], machine="aarch64", bind="1") is None


def test_bound_and_worker_cpus_read_vllms_notations():
    assert [bound_cpus(b) for b in ("1", "0,2", "4-7", "0-1,3", "0-3|4-7", "auto", "")] == [1, 2, 4, 3, 0, 0, 0]
    assert worker_cpus({"GOMP_CPU_AFFINITY": "0 1"}) == {0, 1}
    assert worker_cpus({"OMP_PLACES": "{3}"}) == {3}
    assert worker_cpus({}) == set()


def test_other_threads_sees_a_thread_while_it_runs():
    before = len(other_threads())
    release = threading.Event()
    worker = threading.Thread(target=release.wait)
    worker.start()
    try:
        assert len(other_threads()) == before + 1
    finally:
        release.set()
        worker.join()


POOL_PROBE = """
import torch
from services.engines.vllm_start import cpu_start_method, other_threads
print(cpu_start_method(True, other_threads(), bind="1"))
torch.set_num_threads(2)
a = torch.randn(512, 512)
a @ a
print(cpu_start_method(True, other_threads(), bind="1"))
"""


def test_an_openmp_pool_that_has_computed_blocks_the_fork():
    # the case a fork would deadlock in: the parent ran a parallel region on two threads (a one-thread
    # pool, as the rollout server's, starts no thread)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", POOL_PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["fork", "None"], out.stderr[-2000:]
