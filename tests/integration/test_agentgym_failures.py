"""AgentGym servers that restart, hang and refuse closes, as real processes (tests/support/agentgym_fake.py): a
server killed and started again on its port hands out the same ids again, and no step of an episode from before
reaches an environment created after; a task whose reset hangs is sent once and quarantined for the run while
every step publishes full batches and the server keeps answering; a server whose worker threads are all stuck
leaves the rotation; failed and refused closes are retried until the server holds nothing."""

import asyncio
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common.config import load_config
from services.common.errors import InvalidArgument, Unavailable
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.envs import alerts
from services.envs.agentgym.env import _POOLS
from services.envs.agentgym.servers import HEALTHY, LOST, PENDING_CLOSES, REMOTE_OPEN, RESTARTS, STUCK
from services.envs.client import InProcessEnvClient
from services.envs.service import EnvService
from services.rollout.producer import Producer
from tests.support.agentgym_process import FakeServer, follow_next, scripted_producer
from tests.support.producers import play
from tests.support.scripted_policy import ScriptedPolicy, tokenizer  # noqa: F401 - fixture


@pytest.fixture(autouse=True)
def fresh_pools():
    yield
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture
def alerted():
    """The env alerts published while the test runs."""
    seen = []
    alerts.add_sink(seen.append)
    yield seen
    alerts.clear_sinks()


def value(metric, *labels):
    return metric.labels(*labels)._value.get()


def eventually(read, want, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while read() != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return read()


@pytest.mark.parametrize("signal", ["ids", "unreachable"])
def test_no_step_of_an_episode_from_before_a_restart_reaches_an_environment_created_after(tmp_path, signal, alerted):
    """`ids`: the server is back before anything notices it was gone, so the first create after the restart (id 0
    again) shows it. `unreachable`: the health watch finds the port closed while the server is down."""
    server = FakeServer("textcraft", tmp_path)
    again = None
    watch = {"ids": 0, "unreachable": 0.1}[signal]
    options = {"family": "textcraft", "base_url": server.url, "health_every_s": watch}
    try:

        async def main():
            nonlocal again
            client = InProcessEnvClient(EnvService())
            old = await client.create("agentgym", 3, options)
            assert old.info["remote_id"] == 0
            server.kill()
            if signal == "unreachable":
                eventually(lambda: value(RESTARTS, "textcraft", server.url, "unreachable"), 1)
            again = FakeServer("textcraft", tmp_path, port=server.port)
            new = await client.create("agentgym", 3, options)
            assert new.info["remote_id"] == 0  # the same id, another environment
            with pytest.raises(Unavailable, match="restarted after this episode's environment was created"):
                await client.step(old.episode_id, "get 1 plank")
            await client.close(old.episode_id)  # not sent: it would close the new episode's environment
            stats = httpx.get(again.url + "/__stats").json()
            assert stats["steps"] == 0 and stats["closes"] == 0
            assert "2 to go" in (await client.step(new.episode_id, "get 1 plank")).observation  # untouched
            await client.close(new.episode_id)

        asyncio.run(main())
        assert value(RESTARTS, "textcraft", server.url, signal) == 1
        assert value(LOST, "textcraft", server.url) == 1
        assert eventually(lambda: [a["what"] for a in alerted], ["env_server_restarted"]) == ["env_server_restarted"]
        assert alerted[0]["server"] == server.url and f"{server.url} restarted" in alerted[0]["message"]
        assert eventually(lambda: httpx.get(again.url + "/__live").json(), 0) == 0
        assert value(REMOTE_OPEN, "textcraft", server.url) == 0
    finally:
        server.kill()
        if again is not None:
            again.kill()


def test_out_of_order_creates_are_not_a_restart(tmp_path):
    server = FakeServer("babyai", tmp_path, FAKE_SLOW_S="0.01")
    try:

        async def main():
            client = InProcessEnvClient(EnvService())
            options = {"family": "babyai", "base_url": server.url, "max_concurrent": 8}
            states = await asyncio.gather(*(client.create("agentgym", 1, options) for _ in range(16)))
            for state in states:
                assert not (await client.step(state.episode_id, "move forward")).done
                await client.close(state.episode_id)

        asyncio.run(main())
        assert value(RESTARTS, "babyai", server.url, "ids") == 0
    finally:
        server.kill()


def test_a_run_over_a_hanging_task_quarantines_it_after_one_reset_and_the_server_keeps_answering(
    tokenizer, tmp_path, redis_url, run_name
):
    """The real producer over the agent loop on a server with 6 worker threads: the first group's task hangs
    its reset. One reset of it is sent (the group's other episodes wait for it, then give up without calling),
    the task is quarantined in Redis and announced, its slot is replayed on another task, every step publishes
    all its groups, and GET / answers in under a second throughout."""
    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            "learner.steps=3",
            "rollout.groups_per_step=2",
            "rollout.group_size=4",
            "rollout.group_retry_backoff_s=0.2",
            "env.name=agentgym",
            "env.max_turns=8",
            f"env.data_dir={tmp_path}",
            "env.train_tasks=8",
            "env.options={family: babyai, base_url: 'http://127.0.0.1:1', timeout_s: 1.5}",
        ],
    )
    probe = Producer(config, None, None, None, SimpleCore(), holder="probe")
    hanging = probe.task_of(0)
    server = FakeServer("babyai", tmp_path, FAKE_HANG_TASKS=str(hanging), FAKE_THREADS="6")
    config.env.options["base_url"] = server.url
    answered, stop = [], threading.Event()

    def ping():
        while not stop.wait(0.2):
            start = time.monotonic()
            try:
                httpx.get(server.url + "/", timeout=5)
            except httpx.HTTPError:
                pass
            answered.append(time.monotonic() - start)

    pinger = threading.Thread(target=ping, daemon=True)
    pinger.start()
    state = RunState.connect(config)
    try:
        stream = TrajectoryStream(state.client, state.trajectories_key)
        producer = scripted_producer(config, tokenizer, follow_next, EnvService(step_timeout_s=5), stream)
        asyncio.run(asyncio.wait_for(play(producer), 90))
        assert stream.length() == 6, "every step got all its groups"
        assert list(state.quarantined_tasks()) == [hanging]
        assert state.quarantined_tasks()[hanging]["reason"] == "hung"
        assert state.rollout_counters()["tasks_quarantined"] == 1
        assert server.url in state.last_group_failure()["message"]
        alerts = [m for _, m in state.read_metrics() if m.get("kind") == "alert"]
        assert len(alerts) == 1 and alerts[0]["task"] == hanging and server.url in alerts[0]["message"]
        assert httpx.get(server.url + "/__stats", timeout=5).json()["hung_resets"] == 1
        assert value(STUCK, "babyai", server.url) == 1
    finally:
        stop.set()
        pinger.join(10)
        state.reset()
        server.kill()
    assert answered and max(answered) < 1.0, f"GET / took up to {max(answered):.2f}s"


class SimpleCore:
    policy_version = 0


def test_a_server_whose_threads_are_all_stuck_leaves_the_rotation(tmp_path, caplog, alerted):
    """Two hung resets hold both worker threads of one server: GET / goes unanswered, the server leaves the
    rotation (reported), and new episodes go to the other server."""
    stuck = FakeServer("babyai", tmp_path, FAKE_HANG_TASKS="7,8", FAKE_THREADS="2")
    good = FakeServer("babyai", tmp_path)
    options = {
        "family": "babyai",
        "base_url": [stuck.url, good.url],
        "timeout_s": 0.5,
        "health_every_s": 0.1,
        "stuck_after_s": 1.0,
    }
    try:

        async def main():
            client = InProcessEnvClient(EnvService(step_timeout_s=5, metrics_registry=CollectorRegistry()))
            for task in (7, 8):  # both go to the first server (no episode open anywhere: the first listed)
                with pytest.raises(InvalidArgument, match=f"{stuck.url}: reset of task {task} never answered"):
                    await client.create("agentgym", task, options)
            assert value(STUCK, "babyai", stuck.url) >= 2  # the hung resets (and a close sent after them)
            assert eventually(lambda: value(HEALTHY, "babyai", stuck.url), 0) == 0
            for _ in range(4):
                state = await client.create("agentgym", 1, options)
                assert state.info["server"] == good.url
                await client.close(state.episode_id)

        asyncio.run(main())
        assert any(f"{stuck.url} is out of rotation: GET / unanswered" in r.getMessage() for r in caplog.records)
        assert value(HEALTHY, "babyai", good.url) == 1
        out = [a for a in alerted if a["what"] == "env_server_out_of_rotation"]
        assert len(out) == 1 and out[0]["server"] == stuck.url
    finally:
        stuck.kill()
        good.kill()


def test_failed_and_refused_closes_are_retried_until_the_server_holds_nothing(tmp_path):
    server = FakeServer("textcraft", tmp_path, FAKE_CLOSE_FAILS="3")
    options = {"family": "textcraft", "base_url": server.url, "health_every_s": 0.1}
    live = lambda: httpx.get(server.url + "/__live", timeout=5).json()  # noqa: E731
    try:

        async def main():
            client = InProcessEnvClient(EnvService())
            states = [await client.create("agentgym", 2, options) for _ in range(3)]
            for state in states:
                await client.close(state.episode_id)

        asyncio.run(main())
        assert eventually(lambda: value(PENDING_CLOSES, "textcraft", server.url), 3) == 3
        assert live() == 3 == value(REMOTE_OPEN, "textcraft", server.url), "a failed close is not counted as closed"
        assert eventually(live, 0) == 0
        assert eventually(lambda: value(REMOTE_OPEN, "textcraft", server.url), 0) == 0
        assert value(PENDING_CLOSES, "textcraft", server.url) == 0
    finally:
        server.kill()


def test_env_alerts_reach_the_runs_metrics_stream(redis_url, run_name):
    config = load_config(None, [f"run={run_name}", f"stream.redis_url={redis_url}"])
    state = RunState.connect(config)
    try:
        alerts.run_stream_sink(config)({"kind": "alert", "what": "env_server_restarted", "message": "m"})
        assert [m for _, m in state.read_metrics()] == [
            {"kind": "alert", "what": "env_server_restarted", "message": "m"}
        ]
    finally:
        state.reset()
