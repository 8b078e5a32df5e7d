"""A run with dynamic sampling on, through the real group claims: a producer whose every third group is
uniform (all its episodes the same reward) and the learner's collect, train (a recording stand-in), push and
acknowledge. Each step trains on full batches of informative groups; the uniform ones are replaced."""

import asyncio
import threading
from types import SimpleNamespace

import pytest

from services.common.config import TrainConfig
from services.common.run_state import AsyncRunState, RunState
from services.common.stream import TrajectoryStream
from services.learner.service import LearnerService, StepTimeout
from services.reward.composer import Scored
from services.rollout import producer as producer_module
from services.rollout.producer import Producer
from services.weightsync import PushResult, WeightPusher
from tests.support.service_fakes import FakeCore, FakeLoop, RecordingTrainer


class SlotRewards:
    """Every third slot's group is uniform (both episodes 1.0); the others are mixed."""

    async def score(self, group):
        slot = int(group[0].group_id[1:])
        return [Scored(1.0 if slot % 3 == 0 else float(i), {"goal": 0.0}, []) for i in range(len(group))]


class CorePusher(WeightPusher):
    """Applies a push to the producer's core at once, as a rollout server does."""

    def __init__(self, core):
        self.core = core

    def push(self, version, weights, addresses, **_):
        self.core.policy_version = version
        return [PushResult(a, True, version, weights.checksum) for a in addresses]


def produce(config, core, sync_state, stop):
    async def main():
        state = AsyncRunState.connect(config)
        producer = Producer(config, FakeLoop(core, sync_state), SlotRewards(), state, core, poll_s=0.005)
        producer._count = lambda **kw: asyncio.sleep(0)
        try:
            await producer.run()
        finally:
            await state.aclose()

    try:
        asyncio.run(main())
    except BaseException as exc:  # noqa: BLE001 - surfaced by the test
        stop.append(exc)


@pytest.fixture(autouse=True)
def no_task_files(monkeypatch):
    monkeypatch.setattr(
        producer_module.TaskSplit,
        "load",
        staticmethod(lambda env, split: SimpleNamespace(draw=lambda key, excluded=frozenset(): 0)),
    )


def test_every_step_trains_a_full_batch_of_informative_groups(redis_url, run_name, tmp_path):
    config = TrainConfig.model_validate(
        {
            "run": run_name,
            "stream": {"redis_url": redis_url, "read_block_ms": 50},
            "rollout": {"groups_per_step": 3, "group_size": 2},
            "algorithm": {"dynamic_sampling": True},
            "learner": {"steps": 3, "step_timeout_s": 20, "checkpoint_dir": str(tmp_path / "ckpt")},
        }
    )
    state = RunState.connect(config)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    core, failures = FakeCore(), []
    producer = threading.Thread(target=produce, args=(config, core, state, failures), daemon=True)
    try:
        state.register_rollout("127.0.0.1:1", {"policy_version": 0})
        stream.ensure_group()
        producer.start()
        trainer = RecordingTrainer()
        try:
            history = LearnerService(config, trainer, CorePusher(core), state, stream).run()
        except StepTimeout:
            if failures:  # the producer's error, not its symptom
                raise failures[0] from None
            raise
        producer.join(timeout=10)
        assert not failures and not producer.is_alive()
        assert [len(groups) for groups in trainer.applied] == [3, 3, 3]
        assert all(int(g[1:]) % 3 for groups in trainer.applied for g in groups), "no uniform group trained"
        filtered = sum(m["groups_filtered"] for m in history)
        assert filtered >= 3 and history[-1]["groups_filtered_total"] == filtered == state.lost_groups()
        assert stream.pending_count() == 0
    finally:
        state.mark_done()
        producer.join(timeout=10)
        state.reset()
