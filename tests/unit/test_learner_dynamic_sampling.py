"""DAPO's dynamic sampling in the learner's collect: groups whose episodes all got the same reward are dropped,
counted lost (so the producers play fresh ones in their place) only when a claim of this run published them,
acknowledged with the step, counted in the step metrics, and capped by algorithm.dynamic_sampling_max_gen_batches."""

from contextlib import contextmanager

import pytest
from prometheus_client import REGISTRY

from services.cli.live import step_stats
from services.common.config import TrainConfig
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.launcher.report import step_line
from services.learner.prometheus_metrics import export_summary
from services.learner.service import DynamicSamplingExhausted, LearnerService, RunFailed
from tests.support.claims import publish_claimed
from tests.support.service_fakes import FakeStream, OkPusher, RecordingTrainer, entry
from tests.support.trajectories import traj


def group(group_id, *rewards, version=0):
    members = [traj(group_id, [version]) for _ in rewards]
    for member, reward in zip(members, rewards):
        member.reward = reward
    return members


def config(dynamic_sampling=True, max_gen_batches=10, groups_per_step=2, **extra):
    return TrainConfig.model_validate(
        {
            "rollout": {"groups_per_step": groups_per_step, "group_size": 2},
            "algorithm": {
                "dynamic_sampling": dynamic_sampling,
                "dynamic_sampling_max_gen_batches": max_gen_batches,
            },
            **extra,
        }
    )


def learner(cfg, entries):
    return LearnerService(cfg, trainer=None, pusher=None, state=None, stream=FakeStream(entries))


def test_uniform_groups_are_dropped_and_replaced_by_later_ones():
    entries = [
        entry("1-0", *group("a", 1.0, 1.0)),  # all solved: no signal
        entry("2-0", *group("b", 0.0, 1.0)),
        entry("3-0", *group("c", 0.0, 0.0)),  # all failed: no signal
        entry("4-0", *group("d", 0.5, 0.25)),
        entry("5-0", *group("e", 0.0, 1.0)),
    ]
    service = learner(config(), entries)
    out = service._collect()
    assert out.groups == {"b", "d"} and {t.group_id for t in out.trajectories} == {"b", "d"}
    assert out.filtered_groups == {"a", "c"}
    assert out.entry_ids == ["1-0", "2-0", "3-0", "4-0"]  # dropped entries are acknowledged with the step
    assert service.stream.reads == [2, 1, 1]  # a dropped group is read again, one slot at a time


def test_without_dynamic_sampling_uniform_groups_train():
    entries = [entry("1-0", *group("a", 1.0, 1.0)), entry("2-0", *group("b", 0, 0))]
    collected = learner(config(dynamic_sampling=False), entries)._collect()
    assert collected.groups == {"a", "b"} and not collected.filtered_groups


def test_a_later_member_of_a_filtered_group_is_dropped_too():
    entries = [entry("1-0", *group("a", 1.0, 1.0)), entry("2-0", *group("a", 0.0)), entry("3-0", *group("b", 0, 1))]
    entries.append(entry("4-0", *group("c", 0, 1)))
    out = learner(config(), entries)._collect()
    assert out.groups == {"b", "c"} and out.filtered_groups == {"a"}


def test_the_cap_fails_the_step_with_a_clear_message():
    # 2 batches of 2 groups: at most 2 filtered groups; the third needs a fifth group in all
    entries = [entry(f"{i}-0", *group(f"u{i}", 1.0, 1.0)) for i in range(3)] + [entry("9-0", *group("b", 0, 1))]
    service = learner(config(max_gen_batches=2), entries)
    with pytest.raises(DynamicSamplingExhausted) as failure:
        service._collect()
    message = str(failure.value)
    assert "step 1: dynamic sampling dropped 3 groups whose episodes all got the same reward" in message
    assert "1/2 groups to train on" in message and "algorithm.dynamic_sampling_max_gen_batches=2" in message
    assert "algorithm.dynamic_sampling=false" in message


def test_the_cap_allows_exactly_its_budget_and_zero_means_no_limit():
    def entries(uniform):
        return [entry(f"{i}-0", *group(f"u{i}", 1.0, 1.0)) for i in range(uniform)] + [
            entry("8-0", *group("b", 0, 1)),
            entry("9-0", *group("c", 0, 1)),
        ]

    assert learner(config(max_gen_batches=2), entries(2))._collect().groups == {"b", "c"}
    assert len(learner(config(max_gen_batches=0), entries(25))._collect().filtered_groups) == 25
    with pytest.raises(DynamicSamplingExhausted):
        learner(config(max_gen_batches=1), entries(1))._collect()


def test_dynamic_sampling_needs_groups_of_two():
    with pytest.raises(ValueError, match="dynamic_sampling needs rollout.group_size >= 2"):
        TrainConfig.model_validate(
            {
                "rollout": {"group_size": 1},
                "algorithm": {"dynamic_sampling": True, "advantage": "reinforce_plus_plus"},
            }
        )


def test_filtered_groups_shift_claims_only_when_a_claim_published_them(run_state):
    state = run_state
    stream = TrajectoryStream(state.client, state.trajectories_key)
    stream.ensure_group()
    publish_claimed(state, group("a", 1.0, 1.0), "a")  # filtered: a replacement is owed
    stream.publish(group("f", 0.0, 0.0), "f")  # filtered too, but no claim of this run published it
    publish_claimed(state, group("b", 0.0, 1.0), "b")
    publish_claimed(state, group("c", 1.0, 0.0), "c")

    def collect():
        service = LearnerService(state.config, trainer=None, pusher=None, state=state, stream=stream)
        service._backlog = stream.read("learner-0", count=100, block_ms=0, pending=True)
        return service, service._collect()

    _, first = collect()
    assert first.groups == {"b", "c"} and first.filtered_groups == {"a", "f"} and state.lost_groups() == 1
    service, again = collect()  # a learner restarted before its checkpoint drops the same entries again
    assert again.filtered_groups == {"a", "f"} and state.lost_groups() == 1
    service._ack(again.entry_ids)
    assert stream.pending_count() == 0


@pytest.fixture
def run_state(redis_url, run_name):
    state = RunState.connect(config(run=run_name, stream={"redis_url": redis_url}))
    yield state
    state.reset()


@contextmanager
def two_step_run(redis_url, run_name, tmp_path, groups, **settings):
    """A 2-step LearnerService run (RecordingTrainer) over `groups`, (group id, its two rewards, policy version)
    published in order with their claims: yields the trainer, the step history, the run state and its stream."""
    cfg = config(
        **settings,
        run=run_name,
        stream={"redis_url": redis_url, "read_block_ms": 50},
        learner={"steps": 2, "step_timeout_s": 5, "checkpoint_dir": str(tmp_path / "ckpt")},
    )
    state = RunState.connect(cfg)
    stream = TrajectoryStream(state.client, state.trajectories_key)
    try:
        state.register_rollout("127.0.0.1:1", {"policy_version": 0})
        stream.ensure_group()
        for gid, rewards, version in groups:
            publish_claimed(state, group(gid, *map(float, rewards), version=version), gid)
        trainer = RecordingTrainer()
        history = LearnerService(cfg, trainer, OkPusher(), state, stream).run()
        yield trainer, history, state, stream
    finally:
        state.reset()


def test_a_run_trains_full_batches_and_counts_the_filtered_groups(redis_url, run_name, tmp_path):
    groups = [("a", (0, 1), 0), ("u1", (1, 1), 0), ("b", (1, 0), 0), ("u2", (0, 0), 1)]
    groups += [(gid, (0, int(gid != "u3")), 1) for gid in ("u3", "c", "d")]
    with two_step_run(redis_url, run_name, tmp_path, groups) as (trainer, history, state, stream):
        assert trainer.applied == [["a", "b"], ["c", "d"]]
        assert [m["groups_filtered"] for m in history] == [1, 2]
        assert [m["groups_filtered_total"] for m in history] == [1, 3]
        assert [m["trajectories_filtered"] for m in history] == [2, 4]  # played beside the 2 x 2 trained
        assert [m["groups_uniform"] for m in history] == [0, 0]
        assert state.lost_groups() == 3 and stream.pending_count() == 0


def test_without_dynamic_sampling_the_steps_count_the_uniform_groups_they_train_on(redis_url, run_name, tmp_path):
    groups = [("a", (0, 1), 0), ("u1", (1, 1), 0), ("u2", (0, 0), 1), ("u3", (0.5, 0.5), 1)]
    with two_step_run(redis_url, run_name, tmp_path, groups, dynamic_sampling=False) as (trainer, history, _, _):
        assert trainer.applied == [["a", "u1"], ["u2", "u3"]]
        assert [m["groups_uniform"] for m in history] == [1, 2]  # zero advantage under grpo, trained anyway
        assert [(m["groups_filtered"], m["trajectories_filtered"]) for m in history] == [(0, 0), (0, 0)]


def test_filtered_groups_reach_prometheus_and_the_step_lines():
    before = REGISTRY.get_sample_value("omrl_learner_filtered_groups_total") or 0
    summary = {"step": 3, "policy_version": 3, "step_seconds": 1.0, "groups_filtered": 4}
    export_summary(summary)
    assert REGISTRY.get_sample_value("omrl_learner_filtered_groups_total") == before + 4
    assert step_line(summary, 10).endswith("| filtered 4") and "filtered 4" in step_stats(summary, None)
    quiet = {**summary, "groups_filtered": 0}
    assert "filtered" not in step_line(quiet, 10) and "filtered" not in step_stats(quiet, None)
    assert step_line({**quiet, "groups_uniform": 2}, 10).endswith("| uniform 2")


def test_an_exhausted_run_is_marked_failed_and_refused_until_its_config_changes(redis_url, run_name, tmp_path):
    def learner_of(max_gen_batches):
        cfg = config(
            max_gen_batches=max_gen_batches,
            run=run_name,
            stream={"redis_url": redis_url, "read_block_ms": 50},
            learner={"steps": 1, "step_timeout_s": 5, "checkpoint_dir": str(tmp_path / "ckpt")},
        )
        trainer = RecordingTrainer()
        return LearnerService(cfg, trainer, OkPusher(), state, stream), trainer

    state = RunState.connect(config(run=run_name, stream={"redis_url": redis_url}))
    stream = TrajectoryStream(state.client, state.trajectories_key)
    try:
        state.register_rollout("127.0.0.1:1", {"policy_version": 0})
        stream.ensure_group()
        for gid, rewards in [("u1", (1, 1)), ("u2", (0, 0)), ("a", (0, 1)), ("b", (1, 0))]:
            publish_claimed(state, group(gid, *map(float, rewards)), gid)
        service, trainer = learner_of(max_gen_batches=1)
        with pytest.raises(DynamicSamplingExhausted) as exhausted:
            service.run()
        failure = state.failure()
        assert failure["reason"] == str(exhausted.value) and failure["reason"].startswith("step 1: dynamic sampling")
        pending = stream.pending_count()
        again, trainer = learner_of(max_gen_batches=1)  # restarted as it was: it fails at once, reading nothing
        with pytest.raises(RunFailed, match="its config has not changed since, so it would fail the same way: step 1"):
            again.run()
        assert trainer.applied == [] and stream.pending_count() == pending
        changed, trainer = learner_of(max_gen_batches=0)  # the limit raised: the mark is cleared and it trains
        assert [m["step"] for m in changed.run()] == [1] and trainer.applied == [["a", "b"]]
        assert state.failure() is None
    finally:
        state.reset()
