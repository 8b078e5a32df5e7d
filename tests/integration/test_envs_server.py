"""`python -m services.envs` as a real process, reached through GrpcEnvClient."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from services.common.grpc_server import free_port, wait_for_health
from services.envs.client import GrpcEnvClient

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 3.0
TEST_ENVS = """
import time
from services.envs.base import StepResult, TextEnv
from services.envs.registry import register_env

@register_env("sleepy")
class Sleepy(TextEnv):
    def reset(self, task_index, options):
        return "zzz"
    def step(self, action):
        time.sleep(float(action))
        return StepResult(f"slept {action}")

@register_env("faulty")
class Faulty(TextEnv):
    def reset(self, task_index, options):
        return "ready"
    def step(self, action):
        raise ValueError(f"cannot {action}")
"""


class Server:
    def __init__(self, tmp: Path, *args: str):
        (tmp / "omrl_test_envs.py").write_text(textwrap.dedent(TEST_ENVS))
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tmp / f"envs-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp)])}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.envs",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--metrics-port",
                    str(self.metrics_port),
                    "--import",
                    "omrl_test_envs",
                    "--grace-s",
                    str(GRACE_S),
                    *args,
                ],
                cwd=ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"envs server did not come up:\n{self.log.read_text()}")
            try:
                asyncio.run(wait_for_health(self.address, 1.0))
                return
            except TimeoutError:
                pass

    def terminate(self) -> tuple[int, float]:
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=GRACE_S), time.monotonic() - start
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"envs server ignored SIGTERM for {GRACE_S}s:\n{self.log.read_text()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("envs"), "--step-timeout-s", "0.5")
    yield srv
    if srv.proc.poll() is None:
        srv.terminate()


def call(address: str, fn):
    async def main():
        async with GrpcEnvClient(address, timeout_s=10) as client:
            return await fn(client)

    return asyncio.run(main())


def test_bound_port_is_logged(server):
    assert f"envs listening on 127.0.0.1:{server.port}" in server.log.read_text()


def test_health_per_service(server):
    asyncio.run(wait_for_health(server.address, 5, service="openmanus.envs.v1.EnvService"))


def test_episode_round_trip(server):
    async def play(client):
        names = {info.name: info for info in await client.list_envs()}
        assert {"corridor", "guess_number", "sleepy", "faulty"} <= set(names)
        state = await client.create("corridor", 17, {"length": 8, "distance": 3, "hint": True})
        assert "<action>" in state.observation
        while not state.done:
            side = "left" if "exit is to the left" in state.observation else "right"
            state = await client.step(state.episode_id, side)
        assert state.success and state.reward == 1.0 and state.info["turn"] == 3
        assert await client.close(state.episode_id) and not await client.close(state.episode_id)

    call(server.address, play)


def test_error_status_codes(server):
    async def errors(client):
        with pytest.raises(NotFound, match="unknown environment 'nope'"):
            await client.create("nope")
        with pytest.raises(NotFound, match="unknown episode"):
            await client.step("0" * 32, "left")
        with pytest.raises(InvalidArgument, match="bogus"):
            await client.create("corridor", 0, {"bogus": True})
        state = await client.create("guess_number", 0, {"max_number": 1})
        await client.step(state.episode_id, "1")
        with pytest.raises(FailedPrecondition, match="is done"):
            await client.step(state.episode_id, "1")
        sleepy = await client.create("sleepy")
        with pytest.raises(DeadlineExceeded, match="sleepy: env call timed out after 0.5s"):
            await client.step(sleepy.episode_id, "1.5")
        with pytest.raises(FailedPrecondition, match="unusable"):
            await client.step(sleepy.episode_id, "0")
        faulty = await client.create("faulty")
        with pytest.raises(Internal, match="faulty: ValueError: cannot jump"):
            await client.step(faulty.episode_id, "jump")
        assert (await client.create("corridor")).observation

    call(server.address, errors)
    with pytest.raises(Unavailable):
        call(f"127.0.0.1:{free_port()}", lambda client: client.list_envs())


def test_concurrent_steps_travel_as_one_batch_and_fail_one_by_one(server):
    from prometheus_client import REGISTRY

    def batches():
        return REGISTRY.get_sample_value("omrl_rollout_env_step_batch_size_count") or 0.0

    async def play():
        async with (
            GrpcEnvClient(server.address, timeout_s=10) as single,
            GrpcEnvClient(server.address, timeout_s=10, batch_steps=True) as batched,
        ):
            tasks = range(17, 22)
            pairs = [
                (
                    await single.create("corridor", t, {"hint": True}),
                    await batched.create("corridor", t, {"hint": True}),
                )
                for t in tasks
            ]
            faulty, sleepy = await batched.create("faulty"), await batched.create("sleepy")
            before = batches()
            results = await asyncio.gather(
                *(batched.step(b.episode_id, "left") for _, b in pairs),
                batched.step(faulty.episode_id, "jump"),
                batched.step("0" * 32, "left"),
                batched.step(sleepy.episode_id, "1.5"),
                return_exceptions=True,
            )
            assert batches() - before == 1  # one StepBatch call for all eight steps
            expected = [await single.step(s.episode_id, "left") for s, _ in pairs]
            for got, want in zip(results[:5], expected):
                assert (got.observation, got.reward, got.done) == (want.observation, want.reward, want.done)
            assert isinstance(results[5], Internal) and "cannot jump" in str(results[5])
            assert isinstance(results[6], NotFound) and "unknown episode" in str(results[6])
            assert isinstance(results[7], DeadlineExceeded)
            state = await batched.step(pairs[0][1].episode_id, "right")  # a batch of one still works
            assert state.episode_id == pairs[0][1].episode_id

    asyncio.run(play())


def test_batched_steps_fall_back_to_single_calls_on_a_server_without_step_batch():
    import grpc

    from services.common.protos import envs_pb2_grpc
    from services.envs.server import EnvServicer
    from services.envs.service import EnvService

    class OldServicer(EnvServicer):
        StepBatch = envs_pb2_grpc.EnvServiceServicer.StepBatch  # answers UNIMPLEMENTED

    async def play():
        grpc_server = grpc.aio.server()
        envs_pb2_grpc.add_EnvServiceServicer_to_server(OldServicer(EnvService()), grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        try:
            async with GrpcEnvClient(f"127.0.0.1:{port}", timeout_s=10, batch_steps=True) as client:
                states = [await client.create("corridor", t) for t in range(3)]
                stepped = await asyncio.gather(*(client.step(s.episode_id, "left") for s in states))
                assert [s.episode_id for s in stepped] == [s.episode_id for s in states]
                assert not client.batch_steps
        finally:
            await grpc_server.stop(None)

    asyncio.run(play())


def test_metrics_endpoint(server):
    call(server.address, lambda client: client.create("corridor"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    assert "omrl_envs_active_episodes" in text
    assert 'omrl_envs_grpc_requests_total{code="OK",method="/openmanus.envs.v1.EnvService/Create"}' in text
    assert 'omrl_envs_errors_total{env="sleepy",kind="DeadlineExceeded"}' in text


def test_sigterm_finishes_in_flight_calls_and_exits_zero(tmp_path):
    srv = Server(tmp_path, "--step-timeout-s", "5")

    async def main():
        async with GrpcEnvClient(srv.address, timeout_s=10) as client:
            state = await client.create("sleepy")
            step = asyncio.ensure_future(client.step(state.episode_id, "1.0"))
            await asyncio.sleep(0.3)
            rc, elapsed = await asyncio.to_thread(srv.terminate)
            return rc, elapsed, await step

    rc, elapsed, state = asyncio.run(main())
    assert rc == 0 and elapsed < GRACE_S
    assert state.observation == "slept 1.0"
    assert "shutting down" in srv.log.read_text()
