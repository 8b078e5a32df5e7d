"""Group leases on a real Redis: a claim is held by one holder, taken over by exactly one other once it
lapses, retried after a failure, dropped once out of attempts, and published at most once."""

import asyncio
import threading

import pytest
import redis

from services.common.config import TrainConfig
from services.common.run_state import AsyncRunState, LeaseOutcome, RunState
from services.common.stream import TrajectoryStream, entry_fields
from tests.support.claims import publish_claimed
from tests.support.trajectories import traj

LONG, NOW = 60.0, 0.0  # a lease with TTL 0 is due at once


@pytest.fixture
def state(redis_url, run_name):
    config = TrainConfig.model_validate({"run": run_name, "stream": {"redis_url": redis_url}})
    state = RunState.connect(config)
    yield state
    state.reset()


def test_claims_stop_at_the_limit_step_and_lost_groups_shift_them(state):
    leases = state.leases
    assert [leases.claim("a", 2, 1, LONG).slot for _ in range(2)] == [0, 1]
    assert leases.claim("a", 2, 1, LONG) is None  # slot 2 is step 1
    state.client.incr(state.k("stale_groups"))
    assert leases.claim("a", 2, 1, LONG).slot == 2  # one group of step 0 was lost: slot 2 replaces it
    assert leases.claim("a", 2, 1, LONG) is None
    assert state.lost_groups() == 1 and leases.remaining(4) == 4 - 3 + 1 + 3


def test_only_an_entry_a_claim_of_the_run_published_counts_lost_and_only_once(state, run_name):
    stream = TrajectoryStream(state.client, state.trajectories_key)
    claimed = [publish_claimed(state, [traj(f"g{i}", [0])], f"g{i}") for i in range(2)]
    foreign = stream.publish([traj("g0", [0])], "g0")  # someone else's entry, even with a claimed group's id
    other = RunState(state.client, TrainConfig.model_validate({"run": f"{run_name}-other"}))
    try:  # another run's producer writing to this run's stream
        lease = other.leases.claim("x", 1, 10, LONG)
        elsewhere = other.leases.publish(lease, state.trajectories_key, 1000, entry_fields([traj("g9", [0])], "g9"))
        assert state.leases.count_lost([foreign, elsewhere, "0-1"]) == 0 and state.lost_groups() == 0
        assert state.leases.count_lost([claimed[0], claimed[0], foreign]) == 1
        assert state.leases.count_lost([claimed[0]]) == 0 and state.lost_groups() == 1  # counted once
        state.leases.settle([claimed[1]])  # acknowledged after a checkpoint: trained, never lost
        assert state.leases.count_lost(claimed) == 0 and state.lost_groups() == 1
        assert other.lost_groups() == 0
    finally:
        other.reset()
    # the one lost group shifts later claims one slot: slot 2 still belongs to step 0
    assert state.leases.claim("a", 2, 1, LONG).slot == 2 and state.leases.claim("a", 2, 1, LONG) is None


def test_claims_skip_the_steps_the_served_policy_is_past_when_the_counter_was_lost(state):
    leases = state.leases
    assert leases.claim("a", 2, 10, LONG, floor_step=0).slot == 0  # a fresh run: nothing skipped
    state.client.delete(state.k("group_claims"))  # Redis came back without it while v3 is served
    assert [leases.claim("a", 2, 10, LONG, floor_step=3).slot for _ in range(2)] == [6, 7]
    assert leases.claim("a", 2, 10, LONG, floor_step=1).slot == 8  # a lower floor never moves claims back


def test_after_a_take_over_only_the_new_holder_renews_and_publishes(state):
    leases, stream = state.leases, TrajectoryStream(state.client, state.trajectories_key)
    lease_a = leases.claim("a", 1, 10, NOW)
    outcome, lease_b = leases.take_over("b", LONG, 5)
    assert outcome is LeaseOutcome.TAKEN and leases.take_over("c", LONG, 5)[0] is LeaseOutcome.NONE
    assert not leases.renew(lease_a, LONG)
    fields = entry_fields([traj("g0", [0]), traj("g0", [0])], "g0")
    assert leases.publish(lease_a, stream.key, 1000, fields) is None
    assert leases.held() == {0: {"holder": "b", "attempt": 2, "task": 1}}  # replayed on the same task
    assert leases.renew(lease_b, LONG) and state.client.xlen(stream.key) == 0


def test_publish_writes_the_stream_entry_and_ends_the_lease(state):
    leases, stream = state.leases, TrajectoryStream(state.client, state.trajectories_key)
    stream.ensure_group()
    leases.claim("a", 1, 10, NOW)
    outcome, lease = leases.take_over("b", LONG, 5)
    assert outcome is LeaseOutcome.TAKEN and lease.taken_from == "a" and lease.attempt == 2
    fields = entry_fields([traj("g0", [0]), traj("g0", [0])], "g0")
    entry_id = leases.publish(lease, stream.key, 1000, fields)
    assert entry_id and leases.publish(lease, stream.key, 1000, fields) is None
    [entry] = stream.read("t", count=10, block_ms=10)
    assert entry.entry_id == entry_id and [t.group_id for t in entry.batch.trajectories] == ["g0", "g0"]
    assert state.client.xrange(stream.key)[0][1][b"n"] == b"2"
    assert leases.held() == {} and leases.remaining(1) == 0 and not leases.renew(lease, LONG)


def test_a_released_slot_comes_back_after_its_back_off_with_a_fresh_task_until_out_of_attempts(state):
    leases = state.leases
    lease = leases.claim("a", 1, 10, LONG)
    assert leases.release(lease, LONG, 3) is LeaseOutcome.TAKEN
    assert leases.take_over("b", LONG, 3)[0] is LeaseOutcome.NONE  # backing off
    assert leases.release(lease, NOW, 3) is None  # no longer a's
    state.client.zadd(state.k("group_lease_expiry"), {lease.slot: 0})  # the back-off is over
    outcome, lease = leases.take_over("b", LONG, 3)
    assert outcome is LeaseOutcome.TAKEN and lease.taken_from == "" and (lease.attempt, lease.task) == (2, 2)
    assert leases.release(lease, NOW, 3) is LeaseOutcome.TAKEN
    outcome, lease = leases.take_over("c", LONG, 3)
    assert (lease.attempt, lease.task) == (3, 3)
    assert leases.release(lease, NOW, 3) is LeaseOutcome.DEAD
    assert leases.held() == {} and state.lost_groups() == 1
    assert leases.claim("c", 1, 1, LONG).slot == 1  # the replacement is still in step 0


def test_a_lapsed_lease_out_of_attempts_is_dropped_not_taken(state):
    leases = state.leases
    leases.claim("a", 1, 10, NOW)
    assert leases.take_over("b", NOW, 2)[0] is LeaseOutcome.TAKEN
    outcome, lease = leases.take_over("c", LONG, 2)
    assert outcome is LeaseOutcome.DEAD and lease.holder == "b" and lease.attempt == 2
    assert leases.held() == {} and state.lost_groups() == 1


def test_many_takers_racing_for_one_lapsed_lease_one_wins(state, redis_url):
    state.leases.claim("dead", 1, 10, NOW)
    takers, barrier, results = 8, threading.Barrier(8), []

    def take(i):
        other = RunState(redis.Redis.from_url(redis_url, socket_timeout=10), state.config)
        barrier.wait()
        results.append(other.leases.take_over(f"t{i}", LONG, 5)[0])

    threads = [threading.Thread(target=take, args=(i,)) for i in range(takers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(results) == sorted([LeaseOutcome.TAKEN] + [LeaseOutcome.NONE] * (takers - 1))
    assert state.leases.held()[0]["attempt"] == 2


def test_the_asyncio_leases_run_the_same_scripts_on_the_same_keys(state):
    async def main():
        server = AsyncRunState.connect(state.config)
        try:
            leases = server.leases
            lease = await leases.claim("a", 1, 10, NOW)
            assert lease.slot == 0 and state.leases.held() == {0: {"holder": "a", "attempt": 1, "task": 1}}
            state.client.zadd(state.k("group_lease_expiry"), {"7": 0})  # due, but its lease is gone
            outcome, taken = await leases.take_over("b", LONG, 5)
            assert outcome is LeaseOutcome.TAKEN and taken.taken_from == "a"
            assert not await leases.renew(lease, LONG) and await leases.renew(taken, LONG)
            assert await leases.release(taken, NOW, 5) is LeaseOutcome.TAKEN
            outcome, again = await leases.take_over("c", LONG, 5)
            assert (again.attempt, again.task) == (3, 2) and await leases.remaining(1) == 1
            fields = entry_fields([traj("g0", [0])], "g0")
            assert await leases.publish(again, state.trajectories_key, 1000, fields)
            assert await leases.remaining(1) == 0 and await leases.take_over("d", LONG, 5) == (LeaseOutcome.NONE, None)
        finally:
            await server.aclose()

    asyncio.run(main())
    assert state.leases.held() == {} and state.client.xlen(state.trajectories_key) == 1
