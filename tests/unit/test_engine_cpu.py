import pytest

from tests.support.engine_cpu import engine_cpu


@pytest.mark.parametrize(
    ("worker", "cpus", "cpu"),
    [(None, [0, 1], 1), ("gw0", [1, 0], 1), ("gw1", [0, 1], 0), ("gw2", [0, 1], 1), ("gw1", [4, 6, 5], 5)],
)
def test_each_xdist_worker_binds_its_engines_to_a_core_of_its_own(worker, cpus, cpu):
    assert engine_cpu(worker, cpus) == cpu
