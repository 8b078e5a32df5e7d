"""The trajectory stream on the real Redis: consumer group delivery, acks, pending, dead letters."""

import pytest

from services.common.stream import TrajectoryStream
from services.common.trajectory import TrajectoryBuilder


def traj(group="g0"):
    b = TrajectoryBuilder(env="corridor", task_index=1, group_id=group, prompt_ids=[1, 2])
    b.add_model_turn(
        [5, 6], [-0.1, -0.2], policy_version=0, text="t", action="left", action_valid=True, finish_reason="stop"
    )
    return b.finish(env_return=0.0, success=False, stop_reason="max_turns")


@pytest.fixture
def stream(redis_url, run_name):
    s = TrajectoryStream.from_url(redis_url, f"omrl-test:{run_name}:trajectories")
    yield s
    s.client.delete(s.key, s.dead_letter_key)


def test_entries_written_before_the_group_exists_are_delivered(stream):
    stream.publish([traj("g0"), traj("g0")])
    stream.ensure_group()
    stream.ensure_group()  # idempotent
    entries = stream.read("c", count=10, block_ms=100)
    assert len(entries) == 1 and [t.group_id for t in entries[0].batch.trajectories] == ["g0", "g0"]


def test_unacked_entries_stay_pending_and_are_redelivered_to_the_same_consumer(stream):
    stream.ensure_group()
    ids = [stream.publish([traj(f"g{i}")]) for i in range(3)]
    got = stream.read("c", count=10, block_ms=100)
    assert [e.entry_id for e in got] == ids
    assert stream.read("c", count=10, block_ms=50) == []
    assert stream.pending_count() == 3
    stream.ack(ids[:2])
    again = stream.read("c", count=10, block_ms=0, pending=True)
    assert [e.entry_id for e in again] == ids[2:]
    stream.ack(ids[2:])
    assert stream.pending_count() == 0 and stream.lag() == 0


def test_unreadable_entry_goes_to_the_dead_letter_stream(stream):
    stream.ensure_group()
    stream.client.xadd(stream.key, {"batch": b"\xff\x00not a protobuf", "n": 1})
    good = stream.publish([traj()])
    entries = stream.read("c", count=10, block_ms=100)
    assert [e.entry_id for e in entries] == [good]
    assert stream.client.xlen(stream.dead_letter_key) == 1
    assert stream.pending_count() == 1  # only the good one waits for its ack
