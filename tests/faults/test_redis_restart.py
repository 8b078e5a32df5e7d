"""Drill: the run's Redis is SIGKILLed twice in the middle of one run and comes back 5 s later each time: first
from its append-only file (the chart's and compose's default), then empty (its files deleted, like a pod
rescheduled without a volume). Every service reconnects. With AOF nothing is lost and nothing is rebuilt.
Empty: the learner rebuilds the run's state from its own step and version (consumer group, policy version,
group claims), and the groups lost with Redis are counted and replaced. The run completes every step with full
batches, none applied twice."""

import shutil
import subprocess
import time

import pytest
import redis

from services.common.grpc_server import free_port
from tests.support.drill import run_drill

pytestmark = [pytest.mark.faults, pytest.mark.e2e]
STEPS, GROUPS, GROUP_SIZE = 7, 4, 4
AOF_AT, EMPTY_AT = 2, 4
"""After the launcher has printed step n, Redis dies: back from its AOF, then back empty."""


class PrivateRedis:
    def __init__(self, directory, port: int, aof: bool):
        self.directory, self.port, self.aof, self.proc = directory, port, aof, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "PrivateRedis":
        self.proc = subprocess.Popen(
            [
                shutil.which("redis-server"),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.aof else "no",
                "--appendfsync",
                "always",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url, socket_timeout=1).ping()
                return self
            except redis.ConnectionError:
                assert time.monotonic() < deadline and self.proc.poll() is None, "private redis did not start"
                time.sleep(0.1)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def forget(self) -> None:
        """Deletes what it persisted: the next start is empty."""
        for path in self.directory.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.fixture(scope="module")
def drill(tmp_path_factory, warm_tiny_model):
    tmp = tmp_path_factory.mktemp("redis-restart")
    (tmp / "redis").mkdir()
    server = PrivateRedis(tmp / "redis", free_port(), aof=True).start()

    def restart(empty: bool):
        def fault(run):
            server.kill()
            if empty:
                server.forget()
            time.sleep(5.0)
            server.start()

        return fault

    try:
        yield run_drill(
            "redis restart (aof, then empty)",
            tmp,
            server.url,
            {AOF_AT: restart(empty=False), EMPTY_AT: restart(empty=True)},
            STEPS,
            GROUPS,
            GROUP_SIZE,
            overrides=("rollout.lease_ttl_s=15", f"model.path={warm_tiny_model}"),
        )
    finally:
        server.kill()


def test_the_run_completes_every_step_with_full_batches(drill):
    assert [m["step"] for m in drill.history] == list(range(1, STEPS + 1))
    assert all(m["trajectories"] == GROUPS * GROUP_SIZE for m in drill.history)


def test_back_from_its_aof_redis_lost_nothing(drill):
    # step EMPTY_AT's metrics were published before the second kill: the AOF restart rebuilt nothing
    assert [m["groups_lost_to_redis"] for m in drill.history[:EMPTY_AT]] == [0] * EMPTY_AT
    assert drill.log("learner").count("Redis lost the run's state") == 1, "rebuilt after the AOF restart too"


def test_back_empty_what_redis_lost_is_counted_and_nothing_is_applied_twice(drill):
    lost = drill.history[-1]["groups_lost_to_redis"]
    print(f"groups lost with Redis: {lost}, rollout counters: {drill.counters}")
    assert "Redis lost the run's state" in drill.log("learner") and 0 <= lost <= GROUPS
    assert max(drill.trajectory_ids.values()) == 1
    entries = [entry for m in drill.history[AOF_AT:] for entry in m["entry_ids"]]
    assert len(entries) == len(set(entries))
