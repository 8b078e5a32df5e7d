"""The learner's poison-input policy (services.learner.poison_guard): each trajectory rule rejects with its
reason, valid records pass, a poisoned group is dead-lettered and counted without touching the other
groups, and a step that fails is isolated to the groups that fail alone."""

import math
from types import SimpleNamespace

import pytest

from services.common.config import TrainConfig
from services.common.run_state import RunState
from services.common.stream import StreamEntry, TrajectoryStream
from services.common.trajectory import TrajectoryBatch, TrajectoryBuilder
from services.learner.poison_guard import (
    LOGPROB_EPSILON,
    MAX_ANCHOR_CHARS,
    Limits,
    Poison,
    PoisonGuard,
    check_trajectory,
)
from services.learner.prometheus_metrics import DEAD_LETTERS
from services.learner.service import CollectedStep
from services.learner.trainer import NonFiniteUpdate
from tests.support.claims import publish_claimed

LIMITS = Limits(vocab_size=64, max_length=32)


def traj(group="g", version=0, model_ids=(5, 6), logprobs=(-0.5, -1.0), reward=1.0):
    b = TrajectoryBuilder(env="t", task_index=0, group_id=group, prompt_ids=[3, 4])
    b.add_model_turn(
        list(model_ids),
        list(logprobs),
        policy_version=version,
        text="",
        action="",
        action_valid=True,
        finish_reason="stop",
    )
    b.add_observation([7], env_reward=0.0)
    t = b.finish(env_return=0.0, success=True, stop_reason="done")
    t.reward = reward
    t.reward_components["goal"] = reward
    return t


def reason_of(t, limits=LIMITS, version=0):
    with pytest.raises(Poison) as info:
        check_trajectory(t, limits, version)
    assert str(info.value)
    return info.value.reason


def test_a_valid_trajectory_passes():
    check_trajectory(traj(), LIMITS, 0)
    check_trajectory(traj(model_ids=(63,), logprobs=(LOGPROB_EPSILON / 2,)), LIMITS, 0)  # rounding above 0
    check_trajectory(traj(version=2), LIMITS, 3)
    check_trajectory(traj(), Limits(vocab_size=None, max_length=32), 0)


def test_a_token_id_outside_the_vocabulary_is_rejected():
    assert reason_of(traj(model_ids=(5, 64), logprobs=(-0.1, -0.1))) == "token_id"


def test_a_trajectory_longer_than_the_context_is_rejected():
    n = 40
    assert reason_of(traj(model_ids=[5] * n, logprobs=[-0.1] * n)) == "too_long"


def test_a_trajectory_longer_than_the_gpu_trains_in_one_row_is_rejected_naming_the_way_out():
    limits = Limits(vocab_size=64, max_length=32, memory_length=10)
    check_trajectory(traj(model_ids=[5] * 5, logprobs=[-0.1] * 5), limits, 0)  # 2 + 5 + 1 = 8 tokens
    with pytest.raises(Poison, match="11 tokens exceed the 10 that fit in the learner's GPU memory") as info:
        check_trajectory(traj(model_ids=[5] * 8, logprobs=[-0.1] * 8), limits, 0)
    assert info.value.reason == "too_long" and "model.max_model_len" in str(info.value)


@pytest.mark.parametrize("field", ["loss_mask", "logprobs"])
def test_lengths_that_differ_are_rejected(field):
    t = traj()
    getattr(t, field).append(0)
    assert reason_of(t) == "lengths"


def test_turns_that_do_not_cover_the_record_are_rejected_without_building_them():
    t = traj()
    t.prompt_length = 2**32 - 1  # a mask of 4G entries would be built if the sizes were not checked first
    assert reason_of(t) == "turns"
    t = traj()
    t.turns[0].start = 1
    assert reason_of(t) == "turns"
    t = traj()
    t.loss_mask[1], t.loss_mask[2] = 1, 0
    assert reason_of(t) == "turns"


def test_a_model_token_at_position_zero_is_rejected():
    b = TrajectoryBuilder(env="t", task_index=0, group_id="g", prompt_ids=[])
    b.add_model_turn([5], [-0.2], policy_version=0, text="", action="", action_valid=True, finish_reason="stop")
    assert reason_of(b.finish(env_return=0.0, success=False, stop_reason="done")) == "turns"


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_and_logprobs_are_rejected(value):
    assert reason_of(traj(reward=value)) == "non_finite"
    t = traj()
    t.reward_components["format"] = value
    assert reason_of(t) == "non_finite"
    assert reason_of(traj(logprobs=(-0.5, value))) == "non_finite"
    t = traj()
    t.turns[0].env_reward = value
    assert reason_of(t) == "non_finite"
    t = traj()
    t.turns[0].process_reward = value
    assert reason_of(t) == "non_finite"


def test_an_anchor_observation_beyond_the_limit_is_rejected():
    t = traj()
    t.turns[0].anchor = "x" * MAX_ANCHOR_CHARS
    check_trajectory(t, LIMITS, 0)
    t.turns[0].anchor += "x"
    assert reason_of(t) == "anchor"


def test_a_positive_logprob_is_rejected():
    assert reason_of(traj(logprobs=(-0.5, 0.01))) == "logprob"


def test_a_policy_version_newer_than_the_learner_is_rejected():
    assert reason_of(traj(version=4), version=3) == "version"


def test_limits_come_from_the_learner_model_and_the_run_config():
    trainer = SimpleNamespace(
        model=SimpleNamespace(config=SimpleNamespace(vocab_size=100, max_position_embeddings=256))
    )
    config = TrainConfig.model_validate({"model": {"max_model_len": 512}})
    assert Limits.for_learner(config, trainer) == Limits(vocab_size=100, max_length=256)
    config.model.max_model_len = 128
    assert Limits.for_learner(config, trainer) == Limits(vocab_size=100, max_length=128)
    assert Limits.for_learner(config, None) == Limits(vocab_size=None, max_length=128)
    trainer.max_row_tokens = 96
    assert Limits.for_learner(config, trainer) == Limits(vocab_size=100, max_length=128, memory_length=96)


# -- the guard, with recording stand-ins for the stream and the run state ------------------------------


class FakeStream:
    def __init__(self):
        self.letters, self.acked = [], []
        self.on_dead_letter = None

    def dead_letter(self, entry_id, reason, error, group_ids=(), extra=None, ack=True):
        self.letters.append(
            {
                "entry_id": entry_id,
                "reason": reason,
                "error": error,
                "groups": list(group_ids),
                "has_batch": b"batch" in (extra or {}),
            }
        )
        if ack:
            self.acked.append(entry_id)
        self.on_dead_letter(entry_id, reason, list(group_ids))

    def ack(self, ids):
        self.acked += list(ids)


class FakeState:
    """Takes every entry for one a claim published (the real accounting is tested on Redis below)."""

    def __init__(self):
        self.lost, self.by_reason, self.counted = 0, {}, set()
        self.leases = self

    def count_lost(self, entry_ids):
        new = set(entry_ids) - self.counted
        self.counted |= new
        self.lost += len(new)
        return len(new)

    def add_dead_letter(self, reason, n):
        self.by_reason[reason] = self.by_reason.get(reason, 0) + n


def entry(entry_id, *trajs):
    batch = TrajectoryBatch(schema_version=1, batch_id=entry_id)
    batch.trajectories.extend(trajs)
    return StreamEntry(entry_id, batch)


def guard(trainer=None):
    trainer = trainer or SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=64)))
    config = TrainConfig.model_validate({"model": {"max_model_len": 64}})
    stream, state = FakeStream(), FakeState()
    return PoisonGuard(config, trainer, state, stream), stream, state


def test_one_bad_trajectory_drops_its_group_only_and_is_counted():
    g, stream, state = guard()
    before = DEAD_LETTERS.labels(reason="token_id")._value.get()
    kept = g.admit(entry("1-0", traj("a"), traj("b"), traj("b", model_ids=(99, 5)), traj("c")), 0)
    assert [t.group_id for t in kept] == ["a", "c"]
    assert stream.letters == [
        {
            "entry_id": "1-0",
            "reason": "token_id",
            "groups": ["b"],
            "has_batch": True,
            "error": stream.letters[0]["error"],
        }
    ]
    assert "99" in stream.letters[0]["error"]
    assert stream.acked == []  # groups a and c are still to be trained: acked with the step's checkpoint
    assert state.lost == 1 and state.by_reason == {"token_id": 1}
    assert DEAD_LETTERS.labels(reason="token_id")._value.get() == before + 1


def test_an_entry_with_nothing_left_is_acked_at_once_and_later_members_of_its_group_are_dropped():
    g, stream, _ = guard()
    assert g.admit(entry("1-0", traj("b", reward=math.nan)), 0) == []
    assert stream.acked == ["1-0"]
    assert g.admit(entry("2-0", traj("b"), traj("d")), 0)[0].group_id == "d"
    step = CollectedStep(trajectories=[traj("x"), traj("y")], groups={"x", "y"})
    g.poisoned.add("x")
    g.purge(step)
    assert step.groups == {"y"} and [t.group_id for t in step.trajectories] == ["y"]


class FlakyTrainer:
    """Fails (train and probe alike) whenever a group in `bad` is in the batch."""

    def __init__(self, bad, error=ValueError):
        self.bad, self.error, self.trained = bad, error, []

    def _fail_on(self, trajs):
        hit = sorted({t.group_id for t in trajs} & set(self.bad))
        if hit:
            raise self.error(f"boom on {hit}")

    def train_step(self, trajs):
        self._fail_on(trajs)
        self.trained.append(sorted({t.group_id for t in trajs}))
        return {"loss": 0.5}

    def probe_step(self, trajs):
        self._fail_on(trajs)
        return {}


def collected(*groups):
    step = CollectedStep()
    for i, gid in enumerate(groups):
        step.trajectories += [traj(gid), traj(gid)]
        step.groups.add(gid)
        step.entry_ids.append(f"{i}-0")
    return step


def admitted(g, step):
    for i, gid in enumerate(dict.fromkeys(t.group_id for t in step.trajectories)):
        g.admit(entry(f"{i}-0", *[t for t in step.trajectories if t.group_id == gid]), 0)


def test_a_failing_step_dead_letters_the_groups_that_fail_alone_and_trains_the_rest():
    trainer = FlakyTrainer(["b", "d"])
    g, stream, state = guard(trainer)
    step = collected("a", "b", "c", "d")
    admitted(g, step)
    assert g.train(trainer, step) == {"loss": 0.5}
    assert trainer.trained == [["a", "c"]] and step.groups == {"a", "c"} and len(step.trajectories) == 4
    assert [(d["entry_id"], d["reason"], d["groups"]) for d in stream.letters] == [
        ("1-0", "train_error", ["b"]),
        ("3-0", "train_error", ["d"]),
    ]
    assert "ValueError: boom on ['b']" in stream.letters[0]["error"]
    assert stream.acked == ["1-0", "3-0"] and state.lost == 2


def test_a_non_finite_update_is_isolated_with_its_own_reason():
    trainer = FlakyTrainer(["b"], error=NonFiniteUpdate)
    g, stream, _ = guard(trainer)
    step = collected("a", "b")
    admitted(g, step)
    g.train(trainer, step)
    assert [d["reason"] for d in stream.letters] == ["non_finite_update"] and trainer.trained == [["a"]]


def test_a_step_whose_every_group_fails_returns_none_to_collect_again():
    trainer = FlakyTrainer(["a", "b"])
    g, stream, _ = guard(trainer)
    step = collected("a", "b")
    assert g.train(trainer, step) is None
    assert step.trajectories == [] and len(stream.letters) == 2


def test_a_failure_no_group_causes_alone_is_raised_unchanged():
    class Broken(FlakyTrainer):
        def train_step(self, trajs):
            raise RuntimeError("CUDA error: device lost")

    trainer = Broken([])
    g, stream, state = guard(trainer)
    step = collected("a", "b")
    with pytest.raises(RuntimeError, match="device lost"):
        g.train(trainer, step)
    assert stream.letters == [] and len(step.trajectories) == 4 and state.lost == 0


# -- which dead letters shift the producers' claims, on a real Redis ------------------------------------


@pytest.fixture
def redis_guard(redis_url, run_name):
    config = TrainConfig.model_validate({"run": run_name, "stream": {"redis_url": redis_url}})
    state = RunState.connect(config)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    stream.ensure_group()
    trainer = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=64)))
    yield PoisonGuard(config, trainer, state, stream), state, stream
    state.reset()


def admit_all(g, stream):
    return [t.group_id for e in stream.read("learner-0", count=100, block_ms=10) for t in g.admit(e, 0)]


def test_only_a_dead_letter_of_a_claimed_group_shifts_claims_and_only_once(redis_guard):
    g, state, stream = redis_guard
    publish_claimed(state, [traj("g0"), traj("g0", model_ids=(99, 5))], "g0")
    publish_claimed(state, [traj("g1")], "g1")
    stream.publish([traj("x", reward=math.nan)], "x")  # poison written by someone else
    stream.publish([traj("g0", model_ids=(99, 5))], "g0")  # a copy of the group already counted: skipped
    state.client.xadd(stream.key, {"batch": b"not a batch", "n": 1})
    assert admit_all(g, stream) == ["g1"]
    assert state.dead_letter_counts() == {"token_id": 1, "non_finite": 1, "undecodable": 1}
    assert state.lost_groups() == 1  # g0 only: the foreign entries held no claim


def test_a_claimed_group_poisoned_by_a_foreign_entry_is_lost_and_counted_once(redis_guard):
    g, state, stream = redis_guard
    publish_claimed(state, [traj("g0")], "g0")
    stream.publish([traj("g0", reward=math.inf)], "g0")  # someone else's poison under g0's id drops g0
    stream.publish([traj("g1", logprobs=(-0.5, 0.5))], "g1")
    claimed_late = publish_claimed(state, [traj("g1")], "g1")  # a member of a poisoned group: dropped
    stream.publish([traj("g1")], "g1")
    assert admit_all(g, stream) == ["g0"]  # collected before the poison came: purged from the step
    step = CollectedStep(trajectories=[traj("g0")], groups={"g0"})
    g.purge(step)
    assert step.groups == set() and g.poisoned == {"g0", "g1"}
    assert state.lost_groups() == 2  # each claimed group once, however many foreign copies came
    assert g.admit(entry(claimed_late, traj("g1")), 0) == [] and state.lost_groups() == 2  # and a replay


def baseline_traj(group, baseline):
    t = traj(group)
    t.baseline = baseline
    return t


@pytest.mark.parametrize("advantage", ["remax", "grpo"])
def test_a_group_without_exactly_its_baseline_episodes_is_dead_lettered(advantage):
    trainer = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=64)))
    config = TrainConfig.model_validate({"model": {"max_model_len": 64}, "algorithm": {"advantage": advantage}})
    stream = FakeStream()
    g = PoisonGuard(config, trainer, FakeState(), stream)
    with_one = [baseline_traj("one", False), baseline_traj("one", True)]
    none = [baseline_traj("none", False), baseline_traj("none", False)]
    two = [baseline_traj("two", True), baseline_traj("two", False), baseline_traj("two", True)]
    kept = g.admit(entry("1-0", *with_one, *none, *two), 0)
    good = "one" if advantage == "remax" else "none"
    assert sorted({t.group_id for t in kept}) == [good]
    letters = stream.letters
    assert sorted(letter["groups"][0] for letter in letters) == sorted({"one", "none", "two"} - {good})
    assert {letter["reason"] for letter in letters} == {"baseline"}
    assert all("baseline episode" in letter["error"] for letter in letters)
