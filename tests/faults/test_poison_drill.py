"""Poison drill: input that gets past the poison guard's checks and still breaks a step. The learner (real service, real
trainer on a tiny model, real Redis) finds the groups that fail alone, dead-letters them with the
exception, trains the step on the rest, leaves nothing pending, and a restart does not trip on them.
Poison that no producer of the run wrote (foreign entries) is dead-lettered too, but shifts no claim: the
producers make no surplus group, so no step drops anything as stale."""

import asyncio
import json
import math
import threading
from types import SimpleNamespace

import pytest

from services.common.config import load_config
from services.common.run_state import AsyncRunState, RunState
from services.common.stream import TrajectoryStream
from services.common.trajectory import TrajectoryBuilder
from services.learner import poison_guard
from services.learner.service import LearnerService
from services.learner.trainer import PolicyTrainer
from services.reward.composer import Scored
from services.rollout import producer as producer_module
from services.rollout.producer import Producer
from services.weightsync.none import NoPush
from tests.support.claims import publish_claimed

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.support.smoke import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", vocab_size=64)


def group(gid, *, token=9, reward=0.5, version=0):
    out = []
    for i in range(2):
        b = TrajectoryBuilder(env="corridor", task_index=0, group_id=gid, prompt_ids=[5, 6])
        b.add_model_turn(
            [token if i else 7, 8],
            [-0.4, -0.9],
            policy_version=version,
            text="",
            action="a",
            action_valid=True,
            finish_reason="stop",
        )
        t = b.finish(env_return=0.0, success=bool(i), stop_reason="done")
        t.reward = reward * i
        out.append(t)
    return out


@pytest.fixture
def run(redis_url, run_name, tmp_path, tiny_llama):
    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            "learner.steps=1",
            "rollout.groups_per_step=4",
            "rollout.group_size=2",
            "stream.read_block_ms=50",
            "learner.step_timeout_s=20",
            "learner.device=cpu",
            f"model.path={tiny_llama}",
            "learner.weight_push=none",
            f"learner.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
    )
    state = RunState.connect(config)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    yield config, state, stream
    state.reset()


def learner(config, state, stream):
    return LearnerService(config, PolicyTrainer(config, config.model.path), NoPush(), state, stream)


def test_groups_that_break_the_step_are_isolated_and_the_step_trains_on_the_rest(run, monkeypatch):
    config, state, stream = run
    monkeypatch.setattr(poison_guard, "check_trajectory", lambda *args: None)  # the poison gets past the checks
    for gid, kwargs in (("good0", {}), ("index", {"token": 64}), ("nan", {"reward": math.nan}), ("good1", {})):
        publish_claimed(state, group(gid, **kwargs), gid)  # as the producers write them

    service = learner(config, state, stream)
    [summary] = service.run()
    assert summary["groups"] == 2 and summary["trajectories"] == 4 and math.isfinite(summary["loss"])
    assert service.trainer.step == 1 and summary["skipped_updates"] == 0.0  # the failed attempt applied nothing
    letters = {d["groups"]: d for d in stream.dead_letters()}
    assert letters.keys() == {"index", "nan"}
    assert letters["index"]["reason"] == "train_error" and "IndexError" in letters["index"]["error"]
    assert letters["nan"]["reason"] == "non_finite_update" and "non-finite" in letters["nan"]["error"]
    assert stream.pending_count() == 0
    assert state.dead_letter_counts() == {"train_error": 1, "non_finite_update": 1} and state.lost_groups() == 2

    # the replacement groups arrive; a restarted learner trains them and never sees the poison again
    config.learner.steps = 2
    for gid in ("good2", "good3", "good4", "good5"):
        stream.publish(group(gid, version=1), gid)
    [summary] = learner(config, state, stream).run()
    assert summary["step"] == 2 and summary["groups"] == 4
    assert stream.pending_count() == 0 and len(stream.dead_letters()) == 2


def test_a_learner_restarted_before_its_checkpoint_replays_the_good_groups_and_not_the_poison(run):
    config, state, stream = run
    config.rollout.groups_per_step, config.learner.checkpoint_every, config.learner.steps = 2, 2, 2
    for gid, kwargs in (
        ("good0", {}),
        ("index", {"token": 640}),
        ("good1", {}),
        ("good2", {"version": 1}),
        ("good3", {"version": 1}),
    ):
        publish_claimed(state, group(gid, **kwargs), gid)
    first = learner(config, state, stream)
    first.resume()
    first.run_step()  # trained, not checkpointed: its good entries stay pending; the poison is acked already
    assert stream.pending_count() == 2
    assert [d["reason"] for d in stream.dead_letters()] == ["token_id"]

    history = learner(config, state, stream).run()  # the "crashed" learner comes back
    assert [h["step"] for h in history] == [1, 2] and all(h["groups"] == 2 for h in history)
    assert stream.pending_count() == 0 and len(stream.dead_letters()) == 1
    assert json.loads(json.dumps(state.dead_letter_counts())) == {"token_id": 1} and state.lost_groups() == 1


def test_a_probe_or_a_non_finite_step_leaves_the_trainer_as_it_was(run):
    from services.learner.trainer import NonFiniteUpdate
    from tests.support.smoke import param_checksum

    config, _, _ = run
    trainer = PolicyTrainer(config, config.model.path)
    before, lr = param_checksum(trainer), trainer.optimizer.param_groups[0]["lr"]
    assert math.isfinite(trainer.probe_step(group("good"))["grad_norm"])
    with pytest.raises(NonFiniteUpdate):
        trainer.train_step(group("good") + group("nan", reward=math.nan))
    assert param_checksum(trainer) == before and trainer.step == 0
    assert trainer.optimizer.param_groups[0]["lr"] == lr and not trainer.optimizer.state
    trainer.train_step(group("good"))
    assert param_checksum(trainer) != before and trainer.step == 1


# -- foreign poison in a run fed by producers ---------------------------------------------------------

FOREIGN_AT_SLOT = 8
"""The foreign entries are written while slot 8 (the first group of step 3) is played: mid-run, the
learner between steps."""


class FeedingLoop:
    """Plays a group at once with the served policy; while slot FOREIGN_AT_SLOT plays, someone else writes
    poison to the run's stream (entries no claim published)."""

    def __init__(self, core, stream):
        self.core, self.stream, self.stats = core, stream, {}

    async def run_group(self, task_index, group_id, seed):
        if group_id == f"g{FOREIGN_AT_SLOT}":
            self.stream.publish(group("foreign-token", token=64), "foreign-token")
            self.stream.publish(group("foreign-nan", reward=math.nan), "foreign-nan")
            self.stream.client.xadd(self.stream.key, {"batch": b"not a batch", "n": 1})
        return group(group_id, version=self.core.policy_version)


class ServedPolicy:
    """The rollout core as the producers see it: the version the learner published."""

    def __init__(self, state):
        self.state = state

    @property
    def policy_version(self):
        return self.state.policy_version()


class Rewards:
    async def score(self, trajs):
        return [Scored(0.5 * i, {"goal": 0.5 * i}, []) for i in range(len(trajs))]


def test_foreign_poison_shifts_no_claims_so_the_producers_make_no_surplus_to_drop_as_stale(run, monkeypatch):
    """Were the 3 foreign dead letters counted as lost groups, the producers would claim 3 surplus slots, each
    group dropped as stale in the next step and counted again: 6 trajectories dropped in most later steps."""
    config, state, stream = run
    config.learner.steps = steps = 6
    per_step = config.rollout.groups_per_step
    monkeypatch.setattr(
        producer_module.TaskSplit,
        "load",
        staticmethod(lambda env, split: SimpleNamespace(draw=lambda key, excluded=frozenset(): 0)),
    )
    core = ServedPolicy(state)
    service, done = learner(config, state, stream), {}
    thread = threading.Thread(target=lambda: done.update(history=service.run()), daemon=True)
    thread.start()

    async def produce():
        producer = Producer(config, FeedingLoop(core, stream), Rewards(), AsyncRunState.connect(config), core, 0.01)
        try:
            await asyncio.wait_for(producer.run(), 120)
        finally:
            await producer.state.aclose()
        return producer

    producer = asyncio.run(produce())
    thread.join(30)
    assert not thread.is_alive() and "history" in done, "the learner did not finish its steps"
    history = done["history"]
    assert [h["groups"] for h in history] == [per_step] * steps
    assert [h["dropped_stale"] for h in history] == [0] * steps and history[-1]["dropped_stale_total"] == 0
    assert state.lost_groups() == 0 and producer.published == steps * per_step  # nothing made in surplus
    assert state.dead_letter_counts() == {"token_id": 1, "non_finite": 1, "undecodable": 1}
    assert stream.pending_count() == 0
