import pytest

from tests.support.worker_cores import engine_cpu, torch_threads_share


@pytest.mark.parametrize(
    ("worker", "cpus", "cpu"),
    [(None, [0, 1], 1), ("gw0", [1, 0], 1), ("gw1", [0, 1], 0), ("gw2", [0, 1], 1), ("gw1", [4, 6, 5], 5)],
)
def test_each_xdist_worker_binds_its_engines_to_a_core_of_its_own(worker, cpus, cpu):
    assert engine_cpu(worker, cpus) == cpu


@pytest.mark.parametrize(("cores", "workers", "threads"), [(2, 2, 1), (16, 4, 4), (2, 3, 1), (3, 2, 1), (8, 0, 8)])
def test_each_xdist_worker_gets_an_even_share_of_the_cores_for_torch(cores, workers, threads):
    assert torch_threads_share(cores, workers) == threads
