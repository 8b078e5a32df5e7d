"""Producers of one run on real Redis and stand-ins for what they drive: the `run` fixture makes producers
that `play` runs to their end, `ScriptedLoop` plays a group at once or hangs, `FlakyRewards` fails on demand,
`LearnerPace` serves a version per full step, and `task_per_key` (autouse where imported) makes each task index
a stable hash of its draw key."""

from types import SimpleNamespace

import pytest

from services.common.config import TrainConfig
from services.common.errors import Unavailable
from services.common.run_state import AsyncRunState, RunState
from services.common.stream import TrajectoryStream
from services.reward.composer import Scored
from services.rollout import producer as producer_module
from services.rollout.producer import Producer
from tests.support.trajectories import traj


class ScriptedLoop:
    """Plays a group at once, or waits for `gate` (a holder that is slow, or hung)."""

    def __init__(self, gate=None):
        self.stats, self.played, self.gate = {}, [], gate

    async def run_group(self, task_index, group_id, seed):
        self.played.append((group_id, task_index))
        if self.gate is not None:
            await self.gate.wait()
        return [traj(group_id, [0]) for _ in range(2)]


class EndingLoop:
    """Plays a group's two episodes, the second ending first, and hands each to `on_episode` as it ends."""

    def __init__(self):
        self.stats, self.played = {}, []

    async def run_group(self, task_index, group_id, seed, on_episode=None):
        self.played.append((group_id, task_index))
        group = [traj(group_id, [0], trajectory_id=f"{group_id}-{i}") for i in range(2)]
        for i in (1, 0):
            if on_episode is not None:
                await on_episode(i, group[i])
        return group


class CountingRewards:
    """Scores a trajectory `<group>-<i>` with i, and records the size of each Score call."""

    def __init__(self):
        self.calls = []

    async def score(self, group):
        self.calls.append(len(group))
        return [Scored(float(t.trajectory_id.rsplit("-", 1)[1]), {"goal": 1.0}, []) for t in group]


class FlakyRewards:
    """Raises Unavailable (the reward service down) for the first `failures` scorings of group g0."""

    def __init__(self, failures=0):
        self.failures = failures

    async def score(self, group):
        if self.failures and group[0].group_id == "g0":
            self.failures -= 1
            raise Unavailable("reward service restarting")
        return [Scored(1.0, {"goal": 1.0}, []) for _ in group]


class LearnerPace:
    """Stands in for the learner: the served version is the number of steps whose groups all arrived."""

    def __init__(self, stream, per_step):
        self.stream, self.per_step = stream, per_step

    @property
    def policy_version(self):
        return self.stream.length() // self.per_step


def make_config(run_name, redis_url, steps=2, reward=None, **rollout):
    return TrainConfig.model_validate(
        {
            "run": run_name,
            "reward": reward or {},
            "stream": {"redis_url": redis_url},
            "learner": {"steps": steps},
            "rollout": {
                "groups_per_step": 2,
                "group_size": 2,
                "lease_ttl_s": 30.0,
                "group_retry_backoff_s": 0.01,
                **rollout,
            },
        }
    )


@pytest.fixture(autouse=True)
def task_per_key(monkeypatch):
    """Task index = a stable hash of the draw key, so a replay on the same or a fresh task shows."""
    monkeypatch.setattr(
        producer_module.TaskSplit,
        "load",
        staticmethod(lambda env, split: SimpleNamespace(draw=lambda key, excluded=frozenset(): sum(key.encode()))),
    )


@pytest.fixture
def run(redis_url, run_name):
    """Makes producers of one run, each with its own AsyncRunState (closed by `play`)."""
    made = []

    def make(loop, rewards, holder, steps=2, reward=None, **rollout):
        config = make_config(run_name, redis_url, steps, reward, **rollout)
        stream = TrajectoryStream(RunState.connect(config).client, config.key("trajectories"))
        made.append(config)
        return Producer(
            config, loop, rewards, AsyncRunState.connect(config), LearnerPace(stream, 2), poll_s=0.01, holder=holder
        )

    yield make
    if made:
        RunState.connect(made[0]).reset()


async def play(producer):
    """Runs the producer to its end, then closes its Redis connections (they belong to this event loop)."""
    try:
        await producer.run()
    finally:
        await producer.state.aclose()


def seen(producer) -> RunState:
    """The producer's run as a blocking client sees it, for assertions."""
    return RunState.connect(producer.config)
