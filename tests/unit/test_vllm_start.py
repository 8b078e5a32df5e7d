"""vLLM's engine processes are forked on the CPU only from a process with no other threads."""

import os
import subprocess
import sys
import threading

from services.rollout.backends.vllm_start import FORK_SAFE_THREADS, cpu_start_method, other_threads


def test_a_single_threaded_process_on_the_cpu_forks():
    assert cpu_start_method(True, []) == "fork"
    assert cpu_start_method(True, sorted(FORK_SAFE_THREADS)) == "fork"


def test_any_other_thread_or_an_unreadable_list_leaves_vllms_spawn():
    assert cpu_start_method(True, ["python"]) is None
    assert cpu_start_method(True, ["jemalloc_bg_thd", "grpc_global_tim"]) is None
    assert cpu_start_method(True, ["?"]) is None


def test_an_explicit_setting_wins_and_a_gpu_keeps_vllms_choice():
    assert cpu_start_method(True, [], requested="spawn") == "spawn"
    assert cpu_start_method(True, ["python"], requested="fork") == "fork"
    assert cpu_start_method(False, []) is None


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
from services.rollout.backends.vllm_start import cpu_start_method, other_threads
print(cpu_start_method(True, other_threads()))
torch.set_num_threads(2)
a = torch.randn(512, 512)
a @ a
print(cpu_start_method(True, other_threads()))
"""


def test_an_openmp_pool_that_has_computed_blocks_the_fork():
    # the case a fork would deadlock in: the parent ran a parallel region on two threads (a one-thread
    # pool, as the rollout server's, starts no thread)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", POOL_PROBE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["fork", "None"], out.stderr[-2000:]
