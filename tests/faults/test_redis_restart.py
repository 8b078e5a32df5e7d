"""Drill: the run's Redis is SIGKILLed in the middle of a run and comes back 5 s later, either empty (no
persistence, like a pod rescheduled without a volume) or from its append-only file (the chart's and
compose's default). Every service reconnects. Empty: the learner rebuilds the run's state from its own step
and version (consumer group, policy version, group claims), and the groups lost with Redis are counted and
replaced. With AOF nothing is lost. Either way the run completes every step with full batches, none applied
twice."""

import shutil
import subprocess
import time

import pytest
import redis

from services.common.grpc_server import free_port
from tests.support.drill import run_drill

pytestmark = [pytest.mark.faults, pytest.mark.e2e]
STEPS, GROUPS, GROUP_SIZE = 6, 4, 4


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


@pytest.fixture(scope="module", params=["empty", "aof"])
def drill(request, tmp_path_factory, warm_tiny_model):
    tmp = tmp_path_factory.mktemp(f"redis-restart-{request.param}")
    server = PrivateRedis(tmp, free_port(), aof=request.param == "aof").start()

    def restart_empty(run):
        server.kill()
        time.sleep(5.0)
        server.start()

    try:
        yield (
            request.param,
            run_drill(
                f"redis restart ({request.param})",
                tmp,
                server.url,
                {2: restart_empty},
                STEPS,
                GROUPS,
                GROUP_SIZE,
                overrides=("rollout.lease_ttl_s=15", f"model.path={warm_tiny_model}"),
            ),
        )
    finally:
        server.kill()


def test_the_run_completes_every_step_with_full_batches(drill):
    _, drill = drill
    assert [m["step"] for m in drill.history] == list(range(1, STEPS + 1))
    assert all(m["trajectories"] == GROUPS * GROUP_SIZE for m in drill.history)


def test_what_redis_lost_is_counted_and_nothing_is_applied_twice(drill):
    persistence, drill = drill
    lost = drill.history[-1]["groups_lost_to_redis"]
    print(f"{persistence}: groups lost with Redis: {lost}, rollout counters: {drill.counters}")
    if persistence == "aof":  # the consumer group, leases and claims came back: nothing to rebuild
        assert "Redis lost the run's state" not in drill.log("learner") and lost == 0
    else:
        assert "Redis lost the run's state" in drill.log("learner") and 0 <= lost <= GROUPS
    assert max(drill.trajectory_ids.values()) == 1
    entries = [entry for m in drill.history[2:] for entry in m["entry_ids"]]
    assert len(entries) == len(set(entries))
