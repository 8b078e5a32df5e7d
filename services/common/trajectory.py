"""The trajectory record (proto `openmanus.trajectory.v1`): building it turn by turn, checking its
invariants, and the bytes that go on the stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence

import numpy as np
from google.protobuf.message import DecodeError

from services.common.protos import trajectory_pb2

SCHEMA_VERSION = 1
Trajectory = trajectory_pb2.Trajectory
Turn = trajectory_pb2.Turn
TrajectoryBatch = trajectory_pb2.TrajectoryBatch


class RecordError(ValueError):
    """A trajectory or batch that breaks the record's contract."""


class TrajectoryBuilder:
    """Accumulates the exact token sequence of one episode; tokens are never re-tokenised."""

    def __init__(
        self,
        *,
        env: str,
        task_index: int,
        group_id: str,
        prompt_ids: Sequence[int],
        rollout_server: str = "",
        trajectory_id: str | None = None,
    ):
        self.record = Trajectory(
            trajectory_id=trajectory_id or uuid.uuid4().hex,
            group_id=group_id,
            env=env,
            task_index=task_index,
            prompt_length=len(prompt_ids),
            rollout_server=rollout_server,
        )
        self._extend(prompt_ids, mask=0)

    def _extend(self, ids: Sequence[int], *, mask: int, logprobs: Sequence[float] | None = None) -> None:
        self.record.token_ids.extend(ids)
        self.record.loss_mask.extend([mask] * len(ids))
        self.record.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def length(self) -> int:
        return len(self.record.token_ids)

    def add_model_turn(
        self,
        ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        policy_version: int,
        text: str,
        action: str,
        action_valid: bool,
        finish_reason: str,
        anchor: str = "",
    ) -> Turn:
        """`anchor`: the env's anchor observation of the state the turn acts from."""
        if len(ids) != len(logprobs):
            raise RecordError(f"{len(ids)} tokens but {len(logprobs)} logprobs")
        turn = self.record.turns.add(
            start=self.length,
            model_tokens=len(ids),
            policy_version=policy_version,
            text=text,
            action=action,
            action_valid=action_valid,
            finish_reason=finish_reason,
            anchor=anchor,
        )
        self._extend(ids, mask=1, logprobs=logprobs)
        return turn

    def add_observation(self, ids: Sequence[int], *, env_reward: float) -> None:
        turn = self.record.turns[-1]
        turn.env_tokens = len(ids)
        turn.env_reward = env_reward
        self._extend(ids, mask=0)

    def finish(self, *, env_return: float, success: bool, stop_reason: str) -> Trajectory:
        self.record.env_return = env_return
        self.record.success = success
        self.record.stop_reason = stop_reason
        self.record.created_at = time.time()
        check_invariants(self.record)
        return self.record


def check_invariants(traj: Trajectory) -> tuple[np.ndarray, np.ndarray]:
    """The record's invariants: token_ids, loss_mask and logprobs of one length, covered by the prompt and the
    turns in order, the loss mask on exactly the model tokens and logprobs nowhere else. Raises RecordError on
    an inconsistent record; returns its loss mask and logprobs as arrays."""
    n = len(traj.token_ids)
    if len(traj.loss_mask) != n or len(traj.logprobs) != n:
        raise RecordError(
            f"{traj.trajectory_id}: token_ids/loss_mask/logprobs lengths differ "
            f"({n}/{len(traj.loss_mask)}/{len(traj.logprobs)})"
        )
    counted = traj.prompt_length + sum(turn.model_tokens + turn.env_tokens for turn in traj.turns)
    if counted != n:  # checked first: the mask built below must never outgrow the record
        raise RecordError(f"{traj.trajectory_id}: prompt and turns cover {counted} tokens, the record has {n}")
    # numpy reads a repeated field's buffer directly: a Python loop over every token here was half of a
    # 64 x 2k-token collate, on the learner's critical path with the GPU idle
    expected = np.zeros(n, dtype=np.uint32)
    position = traj.prompt_length
    for turn in traj.turns:
        if turn.start != position:
            raise RecordError(f"{traj.trajectory_id}: turn starts at {turn.start}, expected {position}")
        expected[position : position + turn.model_tokens] = 1
        position += turn.model_tokens + turn.env_tokens
    mask, logprobs = np.array(traj.loss_mask, dtype=np.uint32), np.array(traj.logprobs, dtype=np.float32)
    if not np.array_equal(mask, expected):
        raise RecordError(f"{traj.trajectory_id}: loss_mask does not match the turns")
    if np.any(logprobs[expected == 0] != 0.0):
        raise RecordError(f"{traj.trajectory_id}: logprob on a non-model token")
    return mask, logprobs


def model_segments(traj: Trajectory) -> list[tuple[int, int]]:
    """[start, end) of each turn's model tokens."""
    return [(t.start, t.start + t.model_tokens) for t in traj.turns if t.model_tokens]


def encode_batch(trajectories: Iterable[Trajectory], batch_id: str | None = None) -> bytes:
    batch = TrajectoryBatch(schema_version=SCHEMA_VERSION, batch_id=batch_id or uuid.uuid4().hex)
    batch.trajectories.extend(trajectories)
    return batch.SerializeToString()


def decode_batch(data: bytes) -> TrajectoryBatch:
    try:
        batch = TrajectoryBatch.FromString(data)
    except DecodeError as exc:
        raise RecordError(f"not a TrajectoryBatch: {exc}") from None
    if batch.schema_version != SCHEMA_VERSION:
        raise RecordError(f"trajectory schema v{batch.schema_version}, this build reads v{SCHEMA_VERSION}")
    for traj in batch.trajectories:
        check_invariants(traj)
    return batch
