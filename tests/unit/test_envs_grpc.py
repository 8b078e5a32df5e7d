"""The env service behind a real in-process gRPC server: the shared server plumbing (health, error
mapping, metrics) and both clients returning the same things."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from services.common.errors import FailedPrecondition, Internal, InvalidArgument, NotFound, Unavailable
from services.common.grpc_server import free_port, serve, wait_for_health
from services.common.protos import envs_pb2_grpc
from services.envs.client import GrpcEnvClient, InProcessEnvClient
from services.envs.server import EnvServicer, add_env_service
from services.envs.service import EnvService
from tests.support.envs_grpc import running


class ExplodingServicer(EnvServicer):
    async def ListEnvs(self, request, context):
        raise RuntimeError("kaboom")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_grpc_and_in_process_clients_agree():
    service = EnvService()

    async def play(client):
        states = [await client.create("corridor", 9, {"length": 10, "distance": 3})]
        for action in ("LEFT", "jump", "right"):
            states.append(await client.step(states[0].episode_id, action))
        states.append(await client.reset(states[0].episode_id, 9))
        assert await client.close(states[0].episode_id)
        return [(s.observation, s.reward, s.done, s.success, s.info) for s in states], await client.list_envs()

    async def main():
        async with running(add_env_service(service)) as address, GrpcEnvClient(address, timeout_s=5) as remote:
            assert await play(remote) == await play(InProcessEnvClient(service))

    run(main())


def test_create_batch_over_grpc_matches_in_process_and_falls_back_on_an_old_server():
    service = EnvService(max_episodes=8)

    class OldServicer(EnvServicer):
        CreateBatch = envs_pb2_grpc.EnvServiceServicer.CreateBatch  # answers UNIMPLEMENTED

    async def group(client, count=3):
        states = await client.create_batch("corridor", 9, {"length": 10, "distance": 3}, count)
        described = [(s.observation, s.reward, s.done, s.info) for s in states]
        for state in states:
            assert await client.close(state.episode_id)
        return described

    async def main():
        old_server = grpc.aio.server()  # a bare server, as one built before CreateBatch: UNIMPLEMENTED
        envs_pb2_grpc.add_EnvServiceServicer_to_server(OldServicer(service), old_server)
        old_address = f"127.0.0.1:{old_server.add_insecure_port('127.0.0.1:0')}"
        await old_server.start()
        try:
            await check(old_address)
        finally:
            await old_server.stop(None)

    async def check(old_address):
        async with (
            running(add_env_service(service)) as address,
            GrpcEnvClient(address, timeout_s=5) as remote,
            GrpcEnvClient(old_address, timeout_s=5) as legacy,
        ):
            expected = await group(InProcessEnvClient(service))
            assert len(expected) == 3 and await group(remote) == expected
            assert remote.batch_creates
            rejected = await remote.create_batch("corridor", 0, {"distance": 7}, 2)  # the env's check, per episode
            assert all(isinstance(s, InvalidArgument) and "distance 7" in str(s) for s in rejected)
            with pytest.raises(NotFound):
                await remote.create_batch("nope", 0, None, 2)
            with pytest.raises(InvalidArgument, match="count must be an int in 1..8"):
                await remote.create_batch("corridor", 0, None, 0)
            with pytest.raises(InvalidArgument, match="count must be an int in 1..8"):
                await remote.create_batch("corridor", 0, None, 9)
            with pytest.raises(InvalidArgument, match="CreateBatchRequest"):
                await remote.create_batch("corridor", 0, None, -1)
            assert await group(legacy) == expected and not legacy.batch_creates  # single creates from then on
            assert await group(legacy) == expected
            assert service.active == 0

    run(main())


def test_health_per_service_and_error_codes():
    service = EnvService()
    closed = []

    async def main():
        async with running(add_env_service(service), on_shutdown=lambda: closed.append(True)) as address:
            await wait_for_health(address, 5)
            await wait_for_health(address, 5, service="openmanus.envs.v1.EnvService")
            async with grpc.aio.insecure_channel(address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
            async with GrpcEnvClient(address, timeout_s=5) as client:
                with pytest.raises(NotFound, match="known: agentgym, babyai, corridor, crafting, guess_number"):
                    await client.create("nope")
                with pytest.raises(InvalidArgument, match="distance 7 needs length >= 9"):
                    await client.create("corridor", 0, {"distance": 7})
                with pytest.raises(InvalidArgument):
                    await client.create("corridor", -1)
                state = await client.create("guess_number", 0, {"max_number": 1})
                await client.step(state.episode_id, "1")
                with pytest.raises(FailedPrecondition) as err:
                    await client.step(state.episode_id, "1")
                assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert closed == [True]
        with pytest.raises(Unavailable):
            async with GrpcEnvClient(address, timeout_s=2) as client:
                await client.list_envs()

    run(main())


def test_unexpected_exception_becomes_internal():
    async def main():
        add = lambda server: envs_pb2_grpc.add_EnvServiceServicer_to_server(  # noqa: E731
            ExplodingServicer(EnvService()), server
        )
        async with running(add) as address, GrpcEnvClient(address, timeout_s=5) as client:
            with pytest.raises(Internal, match="RuntimeError: kaboom"):
                await client.list_envs()

    before = (
        REGISTRY.get_sample_value(
            "omrl_envs_grpc_requests_total", {"method": "/openmanus.envs.v1.EnvService/ListEnvs", "code": "INTERNAL"}
        )
        or 0
    )
    run(main())
    after = REGISTRY.get_sample_value(
        "omrl_envs_grpc_requests_total", {"method": "/openmanus.envs.v1.EnvService/ListEnvs", "code": "INTERNAL"}
    )
    assert after == before + 1


def test_port_in_use_fails_loudly():
    async def main():
        async with running(add_env_service(EnvService())) as address:
            port = int(address.rsplit(":", 1)[1])
            with pytest.raises(RuntimeError):
                await serve("envs", port, [], host="127.0.0.1", stop=asyncio.Event())

    run(main())


def test_free_port_is_bindable_and_outside_the_kernels_ephemeral_range():
    """The ports other processes get from a bind to 0 or for outgoing connections come from the ephemeral
    range: a port handed out for a later bind must not, or one of them can take it first."""
    import socket

    from services.common.grpc_server import _ephemeral_low

    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    if low > 16384:  # Linux, a range that leaves room below it
        assert all(16384 <= p < low and p != 29600 for p in ports), (low, sorted(ports))
        assert len(ports) > 40  # drawn at random, not one port again and again


def test_free_port_draws_again_past_a_port_in_use_and_the_reserved_one(monkeypatch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        unused = unused_port()
        draws = script_draws(monkeypatch, [taken.getsockname()[1], 29600, unused])
        assert free_port() == unused and next(draws, None) is None


def test_free_port_never_hands_out_one_port_twice(monkeypatch):
    """The launcher draws a run's seven ports before any service binds one: a port drawn again (still free, as
    nothing bound it yet) would go to two services, and the second would fail with "Address already in use"."""
    first, unused = free_port(), unused_port()
    draws = script_draws(monkeypatch, [first, first, unused])
    assert free_port() == unused and next(draws, None) is None


def unused_port() -> int:
    """A port free now that `free_port` has not handed out: the kernel's pick, from the ephemeral range."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def script_draws(monkeypatch, ports: list[int]):
    """`free_port` draws `ports` in turn (from the whole port range); the iterator shows what is left undrawn."""
    from services.common import grpc_server

    draws = iter(ports)

    class Drawn:
        def randrange(self, start, stop):
            return next(draws)

    monkeypatch.setattr(grpc_server.random, "SystemRandom", Drawn)
    monkeypatch.setattr(grpc_server, "_ephemeral_low", lambda: 65536)
    return draws
