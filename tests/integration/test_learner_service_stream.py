"""LearnerService's stream contract on the real Redis, with a recording stand-in for the trainer:
groups per step, checkpoint-then-ack, and exactly-once application across a crash."""

import json
import math
import time
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.run_state import RunState
from services.common.stream import TrajectoryStream
from services.common.trajectory import TrajectoryBuilder
from services.learner.service import LearnerService
from services.weightsync import PushResult, WeightPusher
from services.weightsync.none import NoPush
from tests.support.claims import publish_claimed
from tests.support.service_fakes import OkPusher, RecordingTrainer


def group(gid, version, size=2):
    out = []
    for _ in range(size):
        b = TrajectoryBuilder(env="corridor", task_index=0, group_id=gid, prompt_ids=[1])
        b.add_model_turn(
            [2], [-0.3], policy_version=version, text="", action="left", action_valid=True, finish_reason="stop"
        )
        out.append(b.finish(env_return=0.0, success=False, stop_reason="max_turns"))
    return out


@pytest.fixture
def setup(redis_url, run_name, tmp_path):
    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            "learner.steps=3",
            "rollout.groups_per_step=2",
            "stream.read_block_ms=50",
            "learner.step_timeout_s=5",
            f"learner.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
    )
    state = RunState.connect(config)
    state.register_rollout("127.0.0.1:1", {"policy_version": 0})
    stream = TrajectoryStream(state.client, state.trajectories_key)
    for i in range(6):
        stream.publish(group(f"g{i}", version=i // 2))
    yield config, state, stream
    state.reset()


def service(config, state, stream, trainer):
    return LearnerService(config, trainer, OkPusher(), state, stream)


def test_each_step_takes_its_groups_and_acks_after_the_checkpoint(setup):
    config, state, stream = setup
    trainer = RecordingTrainer()
    history = service(config, state, stream, trainer).run()
    assert trainer.applied == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]
    assert [m["policy_version"] for m in history] == [1, 2, 3]
    assert state.policy_version() == 3 and state.done() == "finished"
    assert stream.pending_count() == 0
    for before, after in zip(history, history[1:]):  # the timeline the local bench lines rollout up against
        assert 0 <= before["collect_seconds"] <= before["step_seconds"]
        assert before["started_at"] + before["step_seconds"] <= after["started_at"] + 0.01


def test_crash_between_checkpoint_and_ack_applies_every_batch_exactly_once(setup, monkeypatch):
    config, state, stream = setup
    first = service(config, state, stream, RecordingTrainer())
    first.resume()
    first.run_step()
    calls = {"n": 0}

    def ack_then_crash(ids):
        calls["n"] += 1
        raise RuntimeError("killed after the checkpoint, before the ack")

    monkeypatch.setattr(stream, "ack", ack_then_crash)
    with pytest.raises(RuntimeError, match="killed"):
        first.run_step()
    monkeypatch.undo()
    assert stream.pending_count() == 2  # step 2's entries: checkpointed as consumed, never acked

    trainer = RecordingTrainer()
    resumed = service(config, state, stream, trainer)
    resumed.run()
    applied = [g for step in trainer.applied for g in step]
    assert applied == ["g0", "g1", "g2", "g3", "g4", "g5"], "no group lost, none applied twice"
    assert stream.pending_count() == 0


def test_crash_before_the_checkpoint_trains_the_pending_entries_again(setup):
    config, state, stream = setup
    config.learner.checkpoint_every = 2
    first = service(config, state, stream, RecordingTrainer())
    first.resume()
    first.run_step()  # step 1 applied, not yet checkpointed: its entries stay pending
    assert stream.pending_count() == 2

    trainer = RecordingTrainer()
    service(config, state, stream, trainer).run()
    assert trainer.applied == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]
    assert stream.pending_count() == 0


def test_missing_groups_time_out_with_a_clear_error(setup):
    config, state, stream = setup
    config.learner.steps, config.learner.step_timeout_s = 4, 0.3
    with pytest.raises(Exception, match="step 4: 0/2 groups") as err:
        service(config, state, stream, RecordingTrainer()).run()
    assert "last group dropped" not in str(err.value)


def test_a_learner_left_waiting_says_why_the_rollout_last_dropped_a_group(setup, monkeypatch):
    """Only a failure since the step began to wait: an older one may have been fixed since."""
    config, state, stream = setup
    config.learner.steps, config.learner.step_timeout_s = 4, 0.3
    why = "group slot 7: env service: Unavailable: AgentGym http://10.0.0.7:8000/create: ConnectError"
    state.client.set(state.k("last_group_failure"), json.dumps({"message": "long ago", "time": time.time() - 3600}))
    with pytest.raises(Exception, match="step 4: 0/2 groups") as err:
        service(config, state, stream, RecordingTrainer()).run()
    assert "long ago" not in str(err.value)
    monkeypatch.setattr(type(state), "last_group_failure", lambda self: {"message": why, "time": time.time()})
    with pytest.raises(
        Exception, match=r"step 4: 0/2 groups.*last group dropped \d+s ago: group slot 7: .*10\.0\.0\.7"
    ):
        service(config, state, stream, RecordingTrainer()).run()


def test_trajectories_older_than_the_staleness_bound_are_dropped(setup):
    config, state, stream = setup
    stream.publish(group("old", version=0))
    stream.publish(group("new", version=3))
    config.learner.steps = 4
    config.learner.step_timeout_s = 0.5
    trainer = RecordingTrainer()
    with pytest.raises(Exception, match=r"step 4: 1/2 groups .*\(2 stale trajectories dropped;"):
        service(config, state, stream, trainer).run()
    assert trainer.applied[-1] == ["g4", "g5"]


class RegistryPusher(WeightPusher):
    """Servers that apply every push (their registry entries follow); the first push of v1 also finds a
    server that has just (re)started at v0, which produces the next step's groups once it has v1."""

    def __init__(self, state, stream):
        self.state, self.stream, self.pushes = state, stream, []

    def push(self, version, weights, addresses, **_):
        self.pushes.append((version, list(addresses)))
        for address in addresses:
            self.state.register_rollout(address, {"policy_version": version})
        if version == 1 and len(self.pushes) == 2:
            self.state.register_rollout("127.0.0.1:2", {"policy_version": 0})
        if "127.0.0.1:2" in addresses and version == 1:
            for gid in ("h2", "h3"):
                self.stream.publish(group(gid, version=1))
        return [PushResult(a, True, version, weights.checksum) for a in addresses]


def test_a_server_that_comes_back_behind_is_pushed_the_current_policy(redis_url, run_name, tmp_path):
    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            "learner.steps=2",
            "rollout.groups_per_step=2",
            "stream.read_block_ms=50",
            "learner.step_timeout_s=20",
            f"learner.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
    )
    state = RunState.connect(config)
    try:
        state.register_rollout("127.0.0.1:1", {"policy_version": 0})
        stream = TrajectoryStream(state.client, state.trajectories_key)
        for gid in ("g0", "g1"):
            stream.publish(group(gid, version=0))
        pusher, trainer = RegistryPusher(state, stream), RecordingTrainer()
        LearnerService(config, trainer, pusher, state, stream).run()
        # start-up push (v0), the step's push (v1), then v1 to the server that came back, and step 2's push
        assert pusher.pushes[:3] == [(0, ["127.0.0.1:1"]), (1, ["127.0.0.1:1"]), (1, ["127.0.0.1:2"])]
        assert trainer.applied == [["g0", "g1"], ["h2", "h3"]]
    finally:
        state.reset()


class WipingPusher(OkPusher):
    """Redis restarts empty right after the push of v1; the producers then publish step 2's groups anew."""

    def __init__(self, state, stream):
        self.state, self.stream, self.wiped = state, stream, False

    def push(self, version, weights, addresses, **_):
        if version == 1 and not self.wiped:
            self.wiped = True
            self.state.reset()
            for gid in ("h2", "h3"):
                self.stream.publish(group(gid, version=1))
        return super().push(version, weights, addresses)


def test_the_learner_rebuilds_the_run_when_redis_comes_back_empty(setup):
    config, state, stream = setup
    config.learner.steps = 2
    trainer = RecordingTrainer()
    history = LearnerService(config, trainer, WipingPusher(state, stream), state, stream).run()
    assert trainer.applied == [["g0", "g1"], ["h2", "h3"]]
    assert state.policy_version() == 2 and state.done() == "finished"
    assert int(state.client.get(config.key("group_claims"))) == 2  # claims restart at step 2's slots
    assert history[-1]["groups_lost_to_redis"] == 0 and stream.pending_count() == 0


# -- poison input, with the real trainer on a tiny model -----------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.support.smoke import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", vocab_size=64)


def poisoned(gid, **change):
    """A group of two whose second trajectory is broken by `change` (token, reward or logprob)."""
    trajs = group(gid, version=0)
    bad = trajs[1]
    if "token" in change:
        bad.token_ids[1] = change["token"]
    if "reward" in change:
        bad.reward = change["reward"]
    if "logprob" in change:
        bad.logprobs[1] = change["logprob"]
    return trajs


def test_poison_entries_are_dead_lettered_and_the_step_trains_on_the_good_groups(
    redis_url, run_name, tmp_path, tiny_llama
):
    from services.learner.trainer import PolicyTrainer

    config = load_config(
        None,
        [
            f"run={run_name}",
            f"stream.redis_url={redis_url}",
            "learner.steps=1",
            "rollout.groups_per_step=2",
            "rollout.group_size=2",
            "stream.read_block_ms=50",
            "learner.step_timeout_s=20",
            "learner.device=cpu",
            f"model.path={tiny_llama}",
            "stream.max_entry_bytes=2048",
            "learner.weight_push=none",
            f"learner.checkpoint_dir={tmp_path / 'ckpt'}",
        ],
    )
    state = RunState.connect(config)
    stream = TrajectoryStream(state.client, state.trajectories_key, max_entry_bytes=config.stream.max_entry_bytes)
    try:
        publish_claimed(state, poisoned("vocab", token=64), "vocab")  # as the producers write them
        publish_claimed(state, group("good0", version=0), "good0")
        publish_claimed(state, poisoned("nanreward", reward=float("nan")), "nanreward")
        publish_claimed(state, poisoned("nanlogprob", logprob=float("nan")), "nanlogprob")
        huge = group("huge", version=0)
        huge[0].rollout_server = "x" * 4096  # over max_entry_bytes: rejected before it is decoded
        publish_claimed(state, huge, "huge")
        publish_claimed(state, group("good1", version=0), "good1")

        history = LearnerService(config, PolicyTrainer(config, str(tiny_llama)), NoPush(), state, stream).run()
        assert len(history) == 1
        assert history[0]["trajectories"] == 4 and history[0]["num_trajectories"] == 4.0
        assert history[0]["groups"] == 2 and math.isfinite(history[0]["loss"])
        letters = {(d["reason"], d["groups"]) for d in stream.dead_letters()}
        assert letters == {
            ("token_id", "vocab"),
            ("non_finite", "nanreward"),
            ("non_finite", "nanlogprob"),
            ("too_large", ""),
        }
        assert all(d["error"] for d in stream.dead_letters())
        assert stream.pending_count() == 0
        assert state.dead_letter_counts() == {"token_id": 1, "non_finite": 2, "too_large": 1}
        assert state.lost_groups() == 4  # the producers replace them

        config.learner.steps = 2  # a restart reads the stream again: nothing left to crash on
        stream.publish(group("good2", version=1), "good2")
        stream.publish(poisoned("vocab2", token=1000), "vocab2")
        stream.publish(group("good3", version=1), "good3")
        again = LearnerService(config, PolicyTrainer(config, str(tiny_llama)), NoPush(), state, stream).run()
        assert [h["step"] for h in again] == [2] and again[0]["trajectories"] == 4
        assert stream.pending_count() == 0 and len(stream.dead_letters()) == 5
    finally:
        state.reset()


class LosingPusher(OkPusher):
    """Right after the push of v2, a read for the learner is answered but its reply never arrives."""

    def __init__(self, stream):
        self.stream, self.lost = stream, []

    def push(self, version, weights, addresses, **_):
        if version == 2 and not self.lost:
            self.lost = self.stream.read("learner-0", count=2, block_ms=10)
        return super().push(version, weights, addresses)


def test_entries_whose_delivery_was_lost_are_read_again(setup):
    """A read whose reply never arrived (Redis restarted mid-read) leaves entries pending for the learner
    that no new read returns: the learner takes them back instead of waiting for them forever."""
    config, state, stream = setup
    trainer, pusher = RecordingTrainer(), LosingPusher(stream)
    learner = LearnerService(config, trainer, pusher, state, stream)
    learner.run()
    assert [e.batch.trajectories[0].group_id for e in pusher.lost] == ["g4", "g5"]
    assert trainer.applied == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]] and stream.pending_count() == 0


def test_background_checkpoints_ack_their_entries_once_committed(setup):
    config, state, stream = setup
    config.learner.checkpoint_async = True
    first_trainer = RecordingTrainer()
    first = service(config, state, stream, first_trainer)
    first.resume()
    first.run_step()
    assert stream.pending_count() == 2 and not list(Path(config.learner.checkpoint_dir).glob("step_*"))
    first.run_step()  # commits step 1's checkpoint, then acks step 1's entries; step 2's is in flight
    assert stream.pending_count() == 2
    assert [p.name for p in Path(config.learner.checkpoint_dir).glob("step_*")] == ["step_00000001"]
    assert first_trainer.background == [True, True]
    # the process dies with step 2's checkpoint unwritten: the restart resumes at step 1 and trains g2, g3 again
    trainer = RecordingTrainer()
    service(config, state, stream, trainer).run()
    assert trainer.applied == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]
    assert trainer.background == [True, False]  # the last step's checkpoint is written before the run ends
    assert stream.pending_count() == 0
