"""The thread budget: cores from the cgroup quota and the affinity mask, their split between the processes
of a local run, and the environment the local launcher gives each child (no process is started)."""

from pathlib import Path

import pytest

from services.common import cpu_budget
from services.common.config import TrainConfig
from services.common.cpu_budget import CORES_ENV, Cores, available_cores, cgroup_cpu_quota, split, torch_threads
from services.launcher.local import LocalRun
from services.weightsync.credential import TOKEN_ENV


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_quota_over_period_and_max_is_no_limit(tmp_path):
    write(tmp_path / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    write(tmp_path / "cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota_and_no_cgroup_files(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "200000\n")
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.0
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_the_quota_caps_the_affinity_mask_rounded_down_and_at_least_one(tmp_path, monkeypatch):
    monkeypatch.delenv(CORES_ENV, raising=False)  # a pytest-xdist worker sets its share (tests/support/worker_cores.py)
    assert available_cores(tmp_path, {3, 1, 2, 0}) == Cores((0, 1, 2, 3), 4)
    write(tmp_path / "cpu.max", "250000 100000")
    assert available_cores(tmp_path, {0, 1, 2, 3}) == Cores((0, 1, 2, 3), 2)
    write(tmp_path / "cpu.max", "50000 100000")
    assert available_cores(tmp_path, {0, 1}).count == 1


def test_a_share_of_the_machine_caps_the_cores_a_run_plans_for(tmp_path, monkeypatch):
    """Two runs side by side on two cores, each sized for both, oversubscribed them: OMRL_CORES is each one's share."""
    monkeypatch.setenv(CORES_ENV, "1")
    assert available_cores(tmp_path, {0, 1}) == Cores((0, 1), 1)
    assert split(available_cores(tmp_path, {0, 1}), overlap=False).learner == 1
    monkeypatch.setenv(CORES_ENV, "8")  # a cap, not a claim: never more than the mask
    assert available_cores(tmp_path, {0, 1}).count == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(CORES_ENV, bad)
        with pytest.raises(ValueError, match="OMRL_CORES"):
            available_cores(tmp_path, {0, 1})


@pytest.mark.parametrize(
    ("count", "procs", "learner", "engine_cpus"),
    [
        (1, 1, 1, (0,)),  # one core: one thread each, nothing left to share
        (2, 1, 1, (1,)),  # no spare core below 3: one each, the worker on the last core
        (4, 1, 1, (2, 3)),  # one core left to the small services, the worker the larger half of the rest
        (16, 1, 7, tuple(range(8, 16))),
        (16, 2, 3, tuple(range(8, 16))),  # the learner's share divided between its processes
    ],
)
def test_split_adds_up_to_the_cores(count, procs, learner, engine_cpus):
    budget = split(Cores(tuple(range(count)), count), learner_procs=procs)
    assert (budget.learner, budget.engine_cpus, budget.service) == (learner, engine_cpus, 1)
    if count >= 3:
        assert budget.learner * procs + len(budget.engine_cpus) + 1 <= count


def test_a_synchronous_run_gives_the_learner_every_core_but_the_spare_one():
    assert split(Cores(tuple(range(16)), 16), overlap=False).learner == 15
    assert split(Cores(tuple(range(16)), 16), learner_procs=3, overlap=False).learner == 5
    assert split(Cores((0, 1), 2), overlap=False).learner == 2
    assert split(Cores((0,), 1), overlap=False).learner == 1
    assert split(Cores((0, 1), 2), overlap=False).engine_cpus == (1,)  # the worker's share does not change


def test_fixed_shares_and_a_quota_smaller_than_the_mask():
    budget = split(Cores(tuple(range(8)), 8), learner=5, engine=2, service=2)
    assert (budget.learner, budget.engine_cpus, budget.service) == (5, (6, 7), 2)
    assert split(Cores(tuple(range(8)), 2)).engine_cpus == (7,)  # 2 CPUs of quota on 8 visible ones


def test_thread_env_lets_idle_openmp_threads_spin_briefly_then_sleep():
    env = cpu_budget.thread_env(3)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3"
    assert env["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in env


def test_torch_threads_prefers_config_then_the_launchers_share_then_the_budget(tmp_path, monkeypatch):
    write(tmp_path / "cpu.max", "100000 100000")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert torch_threads(5, tmp_path) == 5
    assert torch_threads(0, tmp_path) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert torch_threads(0, tmp_path) == 1


def test_a_rollout_alone_binds_its_worker_to_every_core_of_the_budget_but_one():
    env = cpu_budget.alone_engine_env(Cores((0, 1, 2, 3, 4, 5), 4))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "3,4,5"
    assert env["OMP_NUM_THREADS"] == "1"
    assert cpu_budget.alone_engine_env(Cores((0,), 1))["VLLM_CPU_OMP_THREADS_BIND"] == "0"


def children(config: TrainConfig, monkeypatch, cores: Cores) -> dict[str, dict[str, str]]:
    monkeypatch.setattr("services.launcher.local.available_cores", lambda: cores)
    run = LocalRun(config, say=lambda _: None)
    procs = run.service_processes(run._assign_addresses(), Path("config.yaml"))
    return {p.name: p.env for p in procs}


def test_the_local_launcher_gives_each_child_its_share(monkeypatch):
    monkeypatch.delenv(cpu_budget.SPIN_ENV, raising=False)
    monkeypatch.delenv(cpu_budget.BIND_ENV, raising=False)  # tests/conftest.py binds this test process's engines
    config = TrainConfig()
    config.env.replicas = 2
    config.algorithm.max_staleness = 1  # rollout and learner overlap: they split the cores
    env = children(config, monkeypatch, Cores(tuple(range(8)), 8))
    assert set(env) == {"envs", "envs-1", "reward", "rollout", "learner"}
    assert env["learner"]["OMP_NUM_THREADS"] == "3"
    assert env["rollout"]["VLLM_CPU_OMP_THREADS_BIND"] == "4,5,6,7"
    assert env["rollout"]["OMP_NUM_THREADS"] == "1"
    assert env["rollout"][cpu_budget.SPIN_ENV] == cpu_budget.ENGINE_SPIN_S
    for name in ("envs", "envs-1", "reward"):
        assert env[name]["OMP_NUM_THREADS"] == "1"
    assert all(e["GOMP_SPINCOUNT"] == cpu_budget.OPENMP_IDLE["GOMP_SPINCOUNT"] for e in env.values())
    assert env["learner"][TOKEN_ENV] == env["rollout"][TOKEN_ENV]  # the push token stays
    config.algorithm.max_staleness = 0  # they take turns: the learner gets every core but the spare one
    assert children(config, monkeypatch, Cores(tuple(range(8)), 8))["learner"]["OMP_NUM_THREADS"] == "7"
    monkeypatch.setenv(cpu_budget.SPIN_ENV, "0.05")  # the launcher's environment tunes the spin
    assert children(config, monkeypatch, Cores((0, 1), 2))["rollout"][cpu_budget.SPIN_ENV] == "0.05"


def test_without_a_budget_the_children_get_no_thread_environment(monkeypatch):
    config = TrainConfig()
    config.threads.budget = False
    env = children(config, monkeypatch, Cores((0, 1), 2))
    assert env["envs"] == {} and env["reward"] == {}
    assert set(env["learner"]) == {TOKEN_ENV}


def test_a_bind_in_the_launchers_environment_wins_over_the_split(monkeypatch):
    budget = split(Cores((0, 1), 2))
    monkeypatch.delenv(cpu_budget.BIND_ENV, raising=False)
    assert cpu_budget.engine_env(budget)[cpu_budget.BIND_ENV] == "1"
    monkeypatch.setenv(cpu_budget.BIND_ENV, "0")
    assert cpu_budget.engine_env(budget)[cpu_budget.BIND_ENV] == "0"
