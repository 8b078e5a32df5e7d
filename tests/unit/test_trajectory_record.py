import pytest

from services.common.trajectory import (
    SCHEMA_VERSION,
    RecordError,
    TrajectoryBatch,
    TrajectoryBuilder,
    check_invariants,
    decode_batch,
    encode_batch,
    model_segments,
)


def two_turn_trajectory():
    b = TrajectoryBuilder(env="corridor", task_index=7, group_id="g1", prompt_ids=[1, 2, 3])
    b.add_model_turn(
        [10, 11],
        [-0.5, -0.25],
        policy_version=4,
        text="<action>left</action>",
        action="left",
        action_valid=True,
        finish_reason="stop",
    )
    b.add_observation([20, 21, 22], env_reward=0.0)
    b.add_model_turn([12], [-1.0], policy_version=5, text="x", action="", action_valid=False, finish_reason="length")
    traj = b.finish(env_return=1.0, success=True, stop_reason="done")
    traj.reward = 1.1
    traj.reward_components.update({"goal": 1.0, "format": 0.1})
    return traj


def test_builder_keeps_exact_tokens_masks_and_logprobs():
    traj = two_turn_trajectory()
    assert list(traj.token_ids) == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert list(traj.loss_mask) == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert list(traj.logprobs) == [0, 0, 0, -0.5, -0.25, 0, 0, 0, -1.0]
    assert [t.policy_version for t in traj.turns] == [4, 5]
    assert model_segments(traj) == [(3, 5), (8, 9)]


def test_stream_record_round_trip_is_lossless():
    traj = two_turn_trajectory()
    batch = decode_batch(encode_batch([traj, traj], batch_id="b1"))
    assert batch.schema_version == SCHEMA_VERSION and batch.batch_id == "b1"
    assert len(batch.trajectories) == 2 and batch.trajectories[0] == traj
    assert dict(batch.trajectories[1].reward_components) == {"goal": 1.0, "format": 0.1}


def test_decode_rejects_other_schema_versions():
    data = TrajectoryBatch(schema_version=SCHEMA_VERSION + 1).SerializeToString()
    with pytest.raises(RecordError, match="schema"):
        decode_batch(data)


def test_validate_catches_broken_records():
    traj = two_turn_trajectory()
    traj.loss_mask[0] = 1
    with pytest.raises(RecordError, match="loss_mask"):
        check_invariants(traj)
    traj = two_turn_trajectory()
    traj.logprobs[5] = -0.1
    with pytest.raises(RecordError, match="non-model"):
        check_invariants(traj)
    traj = two_turn_trajectory()
    del traj.logprobs[-1]
    with pytest.raises(RecordError, match="lengths"):
        check_invariants(traj)


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda t: t.loss_mask.__setitem__(3, 2), "loss_mask"),  # a mask is 0 or 1, not any truthy value
        (lambda t: t.logprobs.__setitem__(6, float("nan")), "non-model"),
        (lambda t: t.logprobs.__setitem__(0, float("inf")), "non-model"),
        (lambda t: setattr(t.turns[1], "start", 7), "turn starts at 7, expected 8"),
    ],
)
def test_validate_catches_values_a_hostile_writer_could_send(breakage, message):
    traj = two_turn_trajectory()
    check_invariants(traj)
    breakage(traj)
    with pytest.raises(RecordError, match=message):
        check_invariants(traj)


def test_builder_rejects_mismatched_logprobs():
    b = TrajectoryBuilder(env="e", task_index=0, group_id="g", prompt_ids=[1])
    with pytest.raises(RecordError):
        b.add_model_turn([1, 2], [-1.0], policy_version=0, text="", action="", action_valid=False, finish_reason="stop")
