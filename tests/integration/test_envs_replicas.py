"""Two env-service processes behind one address (gRPC round_robin over both, so consecutive calls of
one episode land on either replica): every call reaches the replica that holds the episode, and when
one replica is killed mid-run the rollout producer keeps going, retries the lost episodes on fresh
environments, and publishes only complete, real groups."""

import asyncio
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from services.common.config import dump_config, load_config
from services.common.errors import Unavailable
from services.common.grpc_server import free_port, wait_for_health
from services.common.run_state import AsyncRunState, RunState
from services.common.stream import TrajectoryStream
from services.common.trajectory import decode_batch
from services.envs.client import GrpcEnvClient, InProcessEnvClient
from services.envs.messages import ToolCall
from services.envs.service import EnvService
from services.reward.client import InProcessRewardClient
from services.reward.composer import RewardComposer
from services.reward.service import RewardService
from services.rollout.action_parsers import PARSERS
from services.rollout.agent_loop import AgentLoop
from services.rollout.producer import Producer
from services.rollout.prompting import ChatFormatter
from tests.support.scripted_policy import ScriptedPolicy, tokenizer, toward_exit  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[2]


class Replica:
    def __init__(self, name: str, config_path: Path, tmp: Path):
        self.name, self.port, self.metrics_port = name, free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
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
                    "--config",
                    str(config_path),
                    "--replica-id",
                    name,
                    "--advertise",
                    self.address,
                    "--registry",
                    "redis",
                    "--grace-s",
                    "1",
                ],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def wait(self) -> None:
        try:
            asyncio.run(wait_for_health(self.address, 60))
        except TimeoutError:
            pytest.fail(f"replica {self.name} did not come up:\n{self.log.read_text()}")

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def cluster(tmp_path, redis_url, run_name):
    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            "env.name=corridor",
            f"env.data_dir={tmp_path / 'data'}",
            "env.train_tasks=200",
            "rollout.group_size=4",
            "rollout.groups_per_step=2",
            "learner.steps=6",
            "algorithm.max_staleness=0",
            "env.max_episode_attempts=3",
        ],
    )
    config_path = tmp_path / "config.yaml"
    config_path.write_text(dump_config(config))
    replicas = [Replica("replica-a", config_path, tmp_path), Replica("replica-b", config_path, tmp_path)]
    try:
        for replica in replicas:
            replica.wait()
        config.env.address = "ipv4:" + ",".join(r.address for r in replicas)
        yield config, replicas
    finally:
        for replica in replicas:
            replica.kill()
        RunState.connect(config).reset()


def test_every_call_reaches_the_replica_that_holds_the_episode(cluster):
    config, replicas = cluster

    async def main():
        async with GrpcEnvClient(config.env.address, timeout_s=10) as client:
            states = [await client.create("corridor", i) for i in range(13)]  # odd: steps alternate owners
            for _ in range(2):
                states = [await client.step(s.episode_id, "left") for s in states]
            closed = [await client.close(s.episode_id) for s in states]
        return {s.episode_id.rpartition(".")[0] for s in states}, closed

    owners, closed = asyncio.run(main())
    assert owners == {"replica-a", "replica-b"}, "creates were spread over both replicas"
    assert all(closed)
    forwarded = sum(r.metric('omrl_envs_forwarded_calls_total{op="Step",outcome="ok"}') for r in replicas)
    assert forwarded > 0, "some steps arrived at the other replica and were forwarded to the owner"
    assert sum(r.metric("omrl_envs_active_episodes") for r in replicas) == 0


def test_a_step_batch_reaches_each_episode_on_its_own_replica(cluster):
    config, replicas = cluster

    async def main():
        async with GrpcEnvClient(config.env.address, timeout_s=10, batch_steps=True) as client:
            states = [await client.create("corridor", i) for i in range(13)]
            stepped = await asyncio.gather(*(client.step(s.episode_id, "left") for s in states))  # one StepBatch
            closed = [await client.close(s.episode_id) for s in stepped]
        return states, stepped, closed

    states, stepped, closed = asyncio.run(main())
    assert {s.episode_id.rpartition(".")[0] for s in states} == {"replica-a", "replica-b"}
    assert [s.episode_id for s in stepped] == [s.episode_id for s in states] and all(closed)
    forwarded = sum(r.metric('omrl_envs_forwarded_calls_total{op="Step",outcome="ok"}') for r in replicas)
    assert forwarded > 0, "the batch's steps of the other replica's episodes were forwarded to their owner"


def test_tool_calls_reach_the_replica_that_holds_the_episode_and_its_workspace(cluster):
    config, replicas = cluster
    call = ToolCall("c", "calculator", '{"expression": "1234 + 4321"}')

    async def main():
        async with GrpcEnvClient(config.env.address, timeout_s=10) as client:
            states = [await client.create("tool_arith", i) for i in range(7)]
            results = [await client.call_tools(s.episode_id, [call, call]) for s in states]
            closed = [await client.close(s.episode_id) for s in states]
        return states, results, closed

    states, results, closed = asyncio.run(main())
    assert {s.episode_id.rpartition(".")[0] for s in states} == {"replica-a", "replica-b"} and all(closed)
    assert all(s.tools[0]["function"]["name"] == "calculator" for s in states)
    assert {(r.content, r.kind) for pair in results for r in pair} == {("5555", "")}
    forwarded = sum(r.metric('omrl_envs_forwarded_calls_total{op="CallTools",outcome="ok"}') for r in replicas)
    assert forwarded > 0, "calls of the other replica's episodes were forwarded to their owner"


class SlowPolicy(ScriptedPolicy):
    async def generate(self, request_id, prompt_ids, sampling):
        await asyncio.sleep(0.1)  # keeps episodes in flight when the replica dies
        return await super().generate(request_id, prompt_ids, sampling)


class LearnerPace:
    """Stands in for the learner: the policy version is the number of steps whose groups all arrived."""

    def __init__(self, stream, per_step):
        self.stream, self.per_step = stream, per_step

    @property
    def policy_version(self):
        return self.stream.length() // self.per_step


def test_a_replica_killed_mid_run_costs_retries_not_trajectories(cluster, tokenizer):
    config, (replica_a, replica_b) = cluster
    state = RunState.connect(config)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    client = GrpcEnvClient(config.env.address, timeout_s=10)
    loop = AgentLoop(
        SlowPolicy(tokenizer, toward_exit),
        client,
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        config.rollout,
        config.env,
        max_model_len=512,
    )
    rewards = InProcessRewardClient(RewardService(RewardComposer.from_config(config.reward)))
    producer = Producer(
        config,
        loop,
        rewards,
        AsyncRunState.connect(config),
        LearnerPace(stream, config.rollout.groups_per_step),
        poll_s=0.02,
        max_attempts=3,
    )
    groups = config.learner.steps * config.rollout.groups_per_step

    async def main():
        run = asyncio.create_task(producer.run())
        # training is under way, and replica b holds episodes in the middle of play
        while stream.length() < 2 or await asyncio.to_thread(replica_b.metric, "omrl_envs_active_episodes") < 2:
            assert not run.done(), run.exception()
            await asyncio.sleep(0.01)
        replica_b.kill()
        await asyncio.wait_for(run, 120)
        await client.aclose()
        await producer.state.aclose()

    start = time.monotonic()
    asyncio.run(main())
    batches = [decode_batch(fields[b"batch"]) for _, fields in state.client.xrange(state.trajectories_key)]
    trajectories = [t for b in batches for t in b.trajectories]
    assert len(batches) == groups and len(trajectories) == groups * config.rollout.group_size
    assert sorted({t.group_id for t in trajectories}) == sorted(f"g{c}" for c in range(groups))
    # the scripted policy always wins: a lost episode that leaked would show as a failure
    assert all(t.success and t.stop_reason == "done" and len(t.turns) == 3 for t in trajectories)
    assert all(t.reward_components["goal"] == 1.0 for t in trajectories)
    counters = state.rollout_counters()
    print("rollout counters:", counters)
    assert counters["groups_published"] == groups
    assert counters["episodes_failed"] >= 1 and counters["episode_retries"] >= 1, counters
    assert counters.get("groups_dead_lettered", 0) == 0
    assert replica_a.proc.poll() is None and replica_b.proc.poll() is not None
    assert time.monotonic() - start < 120


class PoisonTaskClient(InProcessEnvClient):
    """Every episode of one task loses its environment (a task that crashes its env server, say)."""

    def __init__(self, service, poison):
        super().__init__(service)
        self.poison, self.episodes = poison, {}

    async def create(self, env, task_index=0, options=None):
        state = await super().create(env, task_index, options)
        self.episodes[state.episode_id] = task_index
        return state

    async def create_batch(self, env, task_index=0, options=None, count=1):
        states = await super().create_batch(env, task_index, options, count)
        self.episodes.update((s.episode_id, task_index) for s in states if not isinstance(s, Exception))
        return states

    async def step(self, episode_id, action):
        if self.episodes.get(episode_id) == self.poison:
            raise Unavailable("env server crashed")
        return await super().step(episode_id, action)


def test_a_group_out_of_retries_is_dropped_whole_and_replaced(tmp_path, redis_url, run_name, tokenizer):
    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            f"env.data_dir={tmp_path}",
            "env.train_tasks=50",
            "rollout.group_size=3",
            "rollout.groups_per_step=1",
            "learner.steps=1",
            "env.max_episode_attempts=2",
        ],
    )
    state = RunState.connect(config)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    probe = Producer(config, None, None, None, None)
    poison = probe.task_of(0)
    assert probe.task_of(0, attempt=2) != poison
    loop = AgentLoop(
        ScriptedPolicy(tokenizer, toward_exit),
        PoisonTaskClient(EnvService(), poison),
        ChatFormatter(tokenizer),
        PARSERS.create("xml_action"),
        config.rollout,
        config.env,
        max_model_len=512,
    )
    rewards = InProcessRewardClient(RewardService(RewardComposer.from_config(config.reward)))
    producer = Producer(config, loop, rewards, AsyncRunState.connect(config), LearnerPace(stream, 1), poll_s=0.01)

    async def play():
        try:
            await producer.run()
        finally:
            await producer.state.aclose()

    try:
        asyncio.run(asyncio.wait_for(play(), 60))  # one step of one group
        batches = [decode_batch(fields[b"batch"]) for _, fields in state.client.xrange(state.trajectories_key)]
        assert len(batches) == 1 and len(batches[0].trajectories) == 3
        assert {t.task_index for t in batches[0].trajectories} == {probe.task_of(0, attempt=2)}
        assert all(t.success for t in batches[0].trajectories)
        counters = state.rollout_counters()
        assert counters["groups_dropped"] == 1 and counters["groups_retried"] == 1
        assert counters["groups_published"] == 1 and counters["episodes_failed"] >= 2
    finally:
        state.reset()
