"""The env-call deadlines scale with the queue waves of an env that serves a limited number of calls at once."""

import threading

import pytest

from services.common.config import TrainConfig
from services.envs.agentgym.servers import FifoSlots
from services.envs.deadlines import env_deadlines, episodes_in_flight, queue_waves


def config(**sections) -> TrainConfig:
    return TrainConfig.model_validate(sections)


def agentgym(urls, max_concurrent=8, **env):
    return {
        "name": "agentgym",
        "options": {"family": "babyai", "base_url": urls, "max_concurrent": max_concurrent},
        **env,
    }


@pytest.mark.parametrize(
    ("in_flight", "replicas", "capacity", "waves"),
    [(64, 1, None, 1), (64, 1, 8, 8), (65, 1, 8, 9), (8, 1, 8, 1), (1, 1, 8, 1), (64, 4, 8, 2), (64, 3, 8, 3)],
)
def test_waves_are_the_rounds_of_capacity_calls_one_replica_serves(in_flight, replicas, capacity, waves):
    assert queue_waves(in_flight, replicas, capacity) == waves


def test_episodes_in_flight_counts_every_worker_group_on_every_rollout_server():
    assert episodes_in_flight(config()) == 8 * 8
    assert episodes_in_flight(config(rollout={"group_size": 4, "groups_per_step": 3})) == 12
    assert episodes_in_flight(config(algorithm={"max_staleness": 1})) == 2 * 64
    assert episodes_in_flight(config(rollout={"addresses": ["a:1", "b:1"]})) == 2 * 64
    assert episodes_in_flight(config(env={"validation_every": 5, "validation_tasks": 10})) == 64 + 10
    assert episodes_in_flight(config(env={"validation_every": 5, "validation_tasks": 500})) == 64 + 64


def test_builtin_envs_keep_the_unscaled_deadlines():
    d = env_deadlines(config(env={"name": "corridor", "step_timeout_s": 10}))
    assert (d.waves, d.service_s, d.routed_s, d.client_s) == (1, 10, 15, 20)


def test_agentgym_deadlines_scale_with_servers_times_max_concurrent():
    one_server = env_deadlines(config(env=agentgym("http://a:1")))  # 64 episodes, 8 at once
    assert (one_server.waves, one_server.service_s) == (8, 80)
    assert one_server.client_s > one_server.routed_s > one_server.service_s
    four_servers = env_deadlines(config(env=agentgym([f"http://a:{p}" for p in range(1, 5)])))
    assert (four_servers.waves, four_servers.service_s) == (2, 20)
    two_replicas = env_deadlines(config(env=agentgym("http://a:1", replicas=2)))
    assert two_replicas.waves == 4
    enough = env_deadlines(config(env=agentgym("http://a:1", max_concurrent=64)))
    assert (enough.waves, enough.service_s) == (1, 10)


def test_the_service_flag_replaces_the_base_deadline():
    assert env_deadlines(config(env=agentgym("http://a:1")), step_timeout_s=2).service_s == 16


def test_fifo_slots_serve_waiters_in_arrival_order():
    slots = FifoSlots(1)
    assert slots.acquire()
    order, queued = [], []

    def wait(i):
        assert slots.acquire(timeout=10)
        order.append(i)
        slots.release()

    threads = []
    for i in range(5):
        threads.append(threading.Thread(target=wait, args=(i,)))
        threads[-1].start()
        queued.append(i)
        while len(slots._waiters) < len(queued):  # wait until this one queues before the next starts
            threading.Event().wait(0.001)
    slots.release()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3, 4]


def test_fifo_slots_time_out_and_leave_the_queue():
    slots = FifoSlots(1)
    assert slots.acquire()
    assert not slots.acquire(timeout=0.01)
    assert not slots._waiters
    slots.release()
    assert slots.acquire(timeout=0)


def test_a_turns_tool_calls_get_a_deadline_for_the_sandbox_slots_they_may_wait_for():
    rollout = {"group_size": 8, "groups_per_step": 4}
    python = config(env={"name": "tool_arith", "options": {"tool": "python"}, "max_tool_calls": 2}, rollout=rollout)
    # 32 episodes x 2 calls for 8 sandboxes: 8 waves of the 10 s tool deadline, plus the two forwarding margins
    assert env_deadlines(python).tools_client_s == 10 * 8 + 10
    fewer = {"sandbox": {"type": "python", "options": {"max_concurrent": 4}}}
    tight = config(env={"name": "tool_arith", "tools": fewer, "max_tool_calls": 2}, rollout=rollout)
    assert env_deadlines(tight).tools_client_s == 10 * 16 + 10
    unlimited = config(env={"name": "tool_arith"}, rollout=rollout)  # the calculator: no queue
    assert env_deadlines(unlimited).tools_client_s == env_deadlines(unlimited).client_s == 20
