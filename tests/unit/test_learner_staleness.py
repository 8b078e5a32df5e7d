"""The staleness bound on both sides: the producer starts a step's groups only once the served policy is
at most `max_staleness` versions behind, and the learner drops (and counts) trajectories older than that."""

import asyncio
from types import SimpleNamespace

import pytest

from services.common.config import TrainConfig
from services.common.run_state import AsyncRunState, RunState
from services.common.stream import TrajectoryStream
from services.common.trajectory import decode_batch
from services.learner.service import LearnerService
from services.reward.composer import Scored
from services.rollout import producer as producer_module
from services.rollout.producer import Producer
from tests.support.service_fakes import FakeCore, FakeLoop, FakeStream, entry
from tests.support.trajectories import traj


def learner(step, max_staleness, entries, groups_per_step=2):
    config = TrainConfig.model_validate(
        {
            "rollout": {"groups_per_step": groups_per_step, "group_size": 2},
            "algorithm": {"max_staleness": max_staleness},
        }
    )
    service = LearnerService(config, trainer=None, pusher=None, state=None, stream=FakeStream(entries))
    service.step = service.version = step
    return service


def test_learner_drops_and_counts_trajectories_older_than_the_bound():
    # learner at step 5 (policy v5), bound 1: versions >= 4 are fresh enough; the oldest turn decides
    entries = [
        entry("1-0", traj("a", [3, 4]), traj("a", [4, 5])),  # one stale member of group a
        entry("2-0", traj("b", [3]), traj("b", [2])),  # group b entirely stale
        entry("3-0", traj("c", [5]), traj("c", [4, 5])),
    ]
    service = learner(5, 1, entries)
    out = service._collect()
    assert out.groups == {"a", "c"} and len(out.trajectories) == 3
    assert out.dropped_stale == 3 and out.entry_ids == ["1-0", "2-0", "3-0"]  # stale entries are acked too
    assert service.stream.reads == [2, 1]  # a read never asks for more entries than groups are missing


def test_max_staleness_zero_accepts_only_the_current_policy():
    service = learner(
        2, 0, [entry("1-0", traj("a", [2]), traj("a", [1])), entry("2-0", traj("b", [2])), entry("3-0", traj("c", [2]))]
    )
    out = service._collect()
    assert out.groups == {"a", "b"} and out.dropped_stale == 1 and len(out.trajectories) == 2


def test_backlog_is_replayed_step_by_step():
    """After a restart the pending entries of several uncheckpointed steps come back at once; each step
    takes them as the stream delivered them, not all at once."""
    service = learner(0, 0, [])
    service._backlog = [entry(f"{i}-0", traj(f"g{i}", [0])) for i in range(5)]
    assert service._collect().entry_ids == ["0-0", "1-0"]
    assert service._collect().entry_ids == ["2-0", "3-0"]
    service.stream.entries = [entry("9-0", traj("g9", [0]))]
    assert service._collect().entry_ids == ["4-0", "9-0"]


def test_a_stale_group_shifts_claims_once_and_only_if_a_claim_published_it(run_state):
    from tests.support.claims import publish_claimed

    state = run_state(1)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    stream.ensure_group()
    publish_claimed(state, [traj("a", [3]), traj("a", [3])], "a")  # stale at step 5 with bound 1
    stream.publish([traj("f", [2])], "f")  # stale too, but no claim of this run published it
    publish_claimed(state, [traj("b", [3]), traj("b", [5])], "b")  # half stale: the group is kept
    publish_claimed(state, [traj("c", [5])], "c")

    def collect():
        service = LearnerService(state.config, trainer=None, pusher=None, state=state, stream=stream)
        service.step = service.version = 5
        service._backlog = stream.read("learner-0", count=100, block_ms=0, pending=True)
        return service._collect()

    first = collect()
    assert first.groups == {"b", "c"} and first.dropped_stale == 4 and state.lost_groups() == 1
    again = collect()  # a learner restarted before its checkpoint drops the same entries again
    assert again.groups == {"b", "c"} and again.dropped_stale == 4 and state.lost_groups() == 1


# -- the producer's gate -----------------------------------------------------------------------------


class FakeRewards:
    async def score(self, group):
        return [Scored(1.0, {"goal": 1.0}, []) for _ in group]


async def drive(state, drop_every=0):
    """A stand-in learner: takes per_step published groups per step (dropping every `drop_every`-th as
    stale and counting it, as the learner does with late groups), then bumps the served version; done
    after `steps`."""
    config, core = state.config, FakeCore()
    steps, per_step = config.learner.steps, config.rollout.groups_per_step
    stream = TrajectoryStream(state.client, state.trajectories_key)
    loop = FakeLoop(core, state)
    producer = Producer(config, loop, FakeRewards(), AsyncRunState.connect(config), core, poll_s=0.005)
    producer._count = lambda **kw: asyncio.sleep(0)
    task = asyncio.create_task(producer.run())
    taken, seen = 0, 0
    while core.policy_version < steps:
        if task.done():
            task.result()  # a worker's error surfaces here instead of as a hang
        await asyncio.sleep(0.005)
        while seen < stream.length():
            seen += 1
            if drop_every and seen % drop_every == 0:
                state.client.incrby(config.key("stale_groups"), 1)
            else:
                taken += 1
            if taken == per_step:
                taken = 0
                core.policy_version += 1
    state.mark_done()
    try:
        await asyncio.wait_for(task, timeout=5)
    finally:
        await producer.state.aclose()
    published = [decode_batch(fields[b"batch"]).batch_id for _, fields in state.client.xrange(stream.key)]
    return loop.started, published


@pytest.fixture
def run_state(redis_url, run_name):
    made = []

    def make(max_staleness, steps=6, per_step=2):
        config = TrainConfig.model_validate(
            {
                "run": run_name,
                "stream": {"redis_url": redis_url},
                "learner": {"steps": steps},
                "rollout": {"groups_per_step": per_step, "group_size": 2},
                "algorithm": {"max_staleness": max_staleness},
            }
        )
        made.append(RunState.connect(config))
        return made[-1]

    yield make
    for state in made:
        state.reset()


@pytest.fixture(autouse=True)
def no_task_files(monkeypatch):
    monkeypatch.setattr(
        producer_module.TaskSplit,
        "load",
        staticmethod(lambda env, split: SimpleNamespace(draw=lambda key, excluded=frozenset(): 0)),
    )


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_producer_runs_ahead_by_at_most_max_staleness_and_replaces_dropped_groups(max_staleness, run_state):
    state = run_state(max_staleness)
    config = state.config
    started, published = asyncio.run(drive(state, drop_every=3))
    per_step = config.rollout.groups_per_step
    for claim, (version, dropped) in started.items():  # a claim's step counts the groups dropped before it
        assert version >= (claim - dropped) // per_step - max_staleness
    assert any(version < (claim - dropped) // per_step for claim, (version, dropped) in started.items())
    # a third of the groups were dropped as stale, yet every step got its groups (the loop ended): claims
    # went on past the nominal steps * groups_per_step to replace them
    assert len(published) >= config.learner.steps * per_step * 3 // 2 - 1


def test_synchronous_producer_serves_each_step_from_its_own_policy(run_state):
    state = run_state(0)
    config = state.config
    started, published = asyncio.run(drive(state))
    per_step = config.rollout.groups_per_step
    assert len(published) == config.learner.steps * per_step
    assert all(version == claim // per_step and dropped == 0 for claim, (version, dropped) in started.items())
