"""Safety limits of the env service that the other tests do not cover (step deadline, observation cut,
exception isolation: test_env_service.py), and replica routing with in-process servers."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.common.registry import Registry
from services.envs.base import StepResult, TextEnv
from services.envs.builtin.corridor import Corridor
from services.envs.client import GrpcEnvClient, InProcessEnvClient
from services.envs.replicas import RoutedEnvService, StaticDirectory
from services.envs.server import add_env_service
from services.envs.service import EnvService, owner_of
from tests.support.envs_grpc import running


class Endless(TextEnv):
    name = "endless"

    def reset(self, task_index, options):
        return "go"

    def step(self, action):
        if action == "boom":
            raise RuntimeError("env bug")
        return StepResult("again")


def service(**kwargs) -> EnvService:
    envs = Registry("environment")
    for cls in (Endless, Corridor):
        envs.register(cls.name)(cls)
    return EnvService(envs=envs, metrics_registry=CollectorRegistry(), **kwargs)


def test_episode_step_limit_ends_an_episode_the_env_never_ends():
    async def main():
        client = InProcessEnvClient(service(max_episode_steps=3))
        state = await client.create("endless")
        for _ in range(2):
            assert not (await client.step(state.episode_id, "x")).done
        last = await client.step(state.episode_id, "x")
        assert last.done and not last.success and last.info["truncated"] == "max_episode_steps (3)"
        with pytest.raises(FailedPrecondition, match="is done"):
            await client.step(state.episode_id, "x")
        await client.reset(state.episode_id, 0)  # a reset starts the count again
        assert not (await client.step(state.episode_id, "x")).done

    asyncio.run(main())


def test_an_env_exception_leaves_other_episodes_and_the_service_running():
    async def main():
        client = InProcessEnvClient(service())
        a, b = await client.create("endless"), await client.create("corridor", 3)
        results = await asyncio.gather(
            client.step(a.episode_id, "boom"), client.step(b.episode_id, "left"), return_exceptions=True
        )
        assert isinstance(results[0], Exception) and "env bug" in str(results[0])
        assert results[1].observation
        assert (await client.step(a.episode_id, "fine")).observation == "again"

    asyncio.run(main())


def test_episode_ids_name_their_replica():
    svc = service(replica_id="pod-7.envs")
    state = asyncio.run(InProcessEnvClient(svc).create("endless"))
    assert owner_of(state.episode_id) == "pod-7.envs" and len(state.episode_id.rpartition(".")[2]) == 32
    assert owner_of("legacyid") is None
    with pytest.raises(ValueError):
        service(replica_id="has space")


def test_calls_are_forwarded_to_the_owner_and_fail_typed_when_it_is_gone():
    a, b = service(replica_id="a"), service(replica_id="b")
    peers = StaticDirectory({})

    async def main():
        async with (
            running(add_env_service(RoutedEnvService(a, peers))) as addr_a,
            running(add_env_service(RoutedEnvService(b, peers))) as addr_b,
        ):
            peers.peers.update({"a": addr_a, "b": addr_b})
            async with GrpcEnvClient(addr_a, timeout_s=5) as via_a, GrpcEnvClient(addr_b, timeout_s=5) as via_b:
                state = await via_b.create("corridor", 4)  # held by b
                moved = await via_a.step(state.episode_id, "left")  # arrives at a, forwarded to b
                assert moved.info["turn"] == 1 and b.active == 1 and a.active == 0
                assert (await via_a.reset(state.episode_id, 4)).observation == state.observation
                assert await via_a.close(state.episode_id) and b.active == 0
                lost = await via_b.create("corridor", 4)
                del peers.peers["b"]  # b left the directory: its episodes are lost
                with pytest.raises(Unavailable, match="held by env replica b, which is gone"):
                    await via_a.step(lost.episode_id, "left")
                with pytest.raises(NotFound):
                    await via_a.step("a.0123", "left")

    asyncio.run(main())


def test_a_forwarded_call_for_a_foreign_episode_is_not_forwarded_again():
    routed = RoutedEnvService(service(replica_id="a"), StaticDirectory({"b": "127.0.0.1:1"}))
    with pytest.raises(NotFound, match="belongs to replica b, not a"):
        asyncio.run(routed.step("b.abc", "left", forwarded=True))
    with pytest.raises(Unavailable, match="unreachable"):
        asyncio.run(routed.step("b.abc", "left"))
