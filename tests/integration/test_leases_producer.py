"""The producer on real Redis with a scripted agent loop and reward client: a failed group is retried
until it is published (never abandoned), a slot out of attempts is replaced by a new one, and a holder
whose lease was taken over while it played publishes nothing."""

import asyncio
from types import SimpleNamespace

import redis

from services.common.run_state import LeaseOutcome
from services.common.stream import TrajectoryStream
from services.common.trajectory import decode_batch
from tests.support.producers import (  # noqa: F401 - fixtures
    CountingRewards,
    EndingLoop,
    FlakyRewards,
    ScriptedLoop,
    play,
    run,
    seen,
    task_per_key,
)


def stream_of(producer) -> TrajectoryStream:
    return TrajectoryStream(seen(producer).client, producer.state.trajectories_key)


def published(producer):
    entries = seen(producer).client.xrange(producer.state.trajectories_key)
    return [decode_batch(fields[b"batch"]) for _, fields in entries]


def test_a_group_whose_scoring_fails_is_retried_on_a_fresh_task_and_published(run):
    producer = run(ScriptedLoop(), FlakyRewards(failures=2), "a")
    asyncio.run(asyncio.wait_for(play(producer), 30))
    batches = published(producer)
    assert sorted(b.batch_id for b in batches) == ["g0", "g1", "g2", "g3"]  # nothing abandoned, nothing twice
    tasks = [task for group, task in producer.loop.played if group == "g0"]
    assert tasks == [producer.task_of(0, n) for n in (1, 2, 3)] and len(set(tasks)) == 3
    assert sorted(group for group, _ in producer.loop.played if group != "g0") == ["g1", "g2", "g3"]
    counters = seen(producer).rollout_counters()
    assert counters["groups_dropped"] == 2 and counters["groups_released"] == 2 and counters["groups_retried"] == 2
    assert counters["groups_published"] == 4 and "groups_dead_lettered" not in counters
    assert seen(producer).leases.held() == {}


def test_score_each_episode_asks_as_each_episode_ends_and_keeps_each_reward_with_its_episode(run):
    """A reward model's time overlaps the group's other episodes: one Score call an episode, made as it ends (here
    the second first), each reward published on its own episode; `group` makes one call a group."""
    rewards = CountingRewards()
    producer = run(EndingLoop(), rewards, "a", reward={"score_each": "episode"})
    asyncio.run(asyncio.wait_for(play(producer), 30))
    assert rewards.calls == [1] * 8
    for batch in published(producer):
        assert [(t.trajectory_id, t.reward) for t in batch.trajectories] == [
            (f"{batch.batch_id}-0", 0.0),
            (f"{batch.batch_id}-1", 1.0),
        ]
    seen(producer).reset()
    grouped = CountingRewards()
    asyncio.run(asyncio.wait_for(play(run(EndingLoop(), grouped, "b", reward={"score_each": "group"})), 30))
    assert grouped.calls == [2] * 4


def test_a_slot_out_of_attempts_is_dropped_and_a_new_slot_fills_its_step(run):
    producer = run(ScriptedLoop(), FlakyRewards(failures=2), "a", max_group_attempts=2)
    asyncio.run(asyncio.wait_for(play(producer), 30))
    batches = published(producer)
    assert len(batches) == 4 and "g4" in {b.batch_id for b in batches}  # slot 4 replaced the dead one
    counters = seen(producer).rollout_counters()
    assert counters["groups_dead_lettered"] == 1 and counters["groups_published"] == 4
    assert seen(producer).lost_groups() == 1 and seen(producer).leases.held() == {}


def test_a_slow_holder_whose_lease_was_taken_over_publishes_nothing(run):
    async def main():
        gate = asyncio.Event()
        slow = run(ScriptedLoop(gate), FlakyRewards(), "slow", steps=1, groups_per_step=1, lease_ttl_s=0.3)

        async def stalled(lease):  # its event loop too busy to renew
            await asyncio.Event().wait()

        slow._renew = stalled
        playing = asyncio.create_task(play(slow))
        leases, view = slow.state.leases, seen(slow)
        while (taken := await leases.take_over("fast", 30.0, 20))[0] is LeaseOutcome.NONE:
            assert not playing.done()
            await asyncio.sleep(0.05)
        outcome, lease = taken
        assert outcome is LeaseOutcome.TAKEN and lease.taken_from == "slow/0" and lease.task == 1
        gate.set()
        while "groups_superseded" not in view.rollout_counters():
            await asyncio.sleep(0.01)
        assert slow.published == 0 and view.rollout_counters()["groups_superseded"] == 1
        assert stream_of(slow).length() == 0
        assert view.leases.publish(lease, slow.state.trajectories_key, 1000, {"batch": b"x", "n": 0})
        await playing  # the slot is published: the producer is done

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_lease_renewed_while_its_group_plays_is_not_taken_over(run):
    async def main():
        gate = asyncio.Event()
        producer = run(ScriptedLoop(gate), FlakyRewards(), "a", steps=1, groups_per_step=1, lease_ttl_s=0.9)
        leases, renewals = producer.state.leases, []
        renew = leases.renew

        async def counted(lease, ttl):
            held = await renew(lease, ttl)
            renewals.append(lease.slot)
            return held

        leases.renew = counted
        playing = asyncio.create_task(play(producer))
        while len(renewals) < 4:  # the group has played for longer than the TTL
            assert not playing.done()
            await asyncio.sleep(0.01)
        assert (await leases.take_over("b", 30.0, 20))[0] is LeaseOutcome.NONE
        gate.set()
        await playing
        assert producer.published == 1 and "groups_taken_over" not in seen(producer).rollout_counters()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_redis_connection_errors_pause_a_worker_instead_of_ending_it(run):
    producer = run(ScriptedLoop(), FlakyRewards(), "a", steps=1, groups_per_step=1)
    producer.redis_retry_s, failures, claim = 0.01, [], producer.state.leases.claim

    async def flaky_claim(*args):
        if len(failures) < 2:
            failures.append(1)
            raise redis.ConnectionError("Redis restarting")
        return await claim(*args)

    producer.state.leases.claim = flaky_claim
    asyncio.run(asyncio.wait_for(play(producer), 30))
    assert len(failures) == 2 and producer.published == 1


def test_with_dynamic_sampling_the_producer_replaces_a_last_step_group_the_learner_filters_late(run):
    """Every slot of the last step published and no learner has read them: without dynamic sampling the producer is
    done; with it, the learner may still filter one of them, so the producer keeps serving until the learner ends the
    run (a CI run beside a busy process once timed out the last step of tests/integration/test_dynamic_sampling_run.py:
    its producer had finished before the learner filtered a group)."""

    async def main():
        producer = run(ScriptedLoop(), FlakyRewards(), "a", steps=1)
        producer.config.algorithm.dynamic_sampling = True
        producer.core = SimpleNamespace(policy_version=0)  # the learner still collects step 1
        playing = asyncio.create_task(play(producer))
        view, stream = seen(producer), stream_of(producer)
        while stream.length() < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # 20 of the producer's polls: it would have finished by now
        assert not playing.done()
        first = view.client.xrange(producer.state.trajectories_key)[0][0].decode()
        assert view.leases.count_lost([first]) == 1  # the learner filtered it
        while stream.length() < 3:
            await asyncio.sleep(0.01)
        view.mark_done()
        await asyncio.wait_for(playing, 10)
        assert sorted(b.batch_id for b in published(producer)) == ["g0", "g1", "g2"]

    asyncio.run(asyncio.wait_for(main(), 30))
