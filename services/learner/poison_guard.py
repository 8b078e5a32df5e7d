"""Poison input never crashes the learner, never stalls it and never spoils a step.

The policy, applied in this order and deterministic (the same input makes the same decisions on every
rank and after every restart):

1. Entry. The stream dead-letters an entry larger than `stream.max_entry_bytes` before decoding it, and
   one it cannot decode (services.common.stream).
2. Trajectory. Every decoded trajectory is checked against the learner's model and state
   (`check_trajectory`): equal lengths of token_ids / loss_mask / logprobs, length within the context and
   within what the learner's GPU memory trains in one row,
   token ids in [0, vocab), well-formed turns, finite reward, turn rewards and logprobs, logprobs <=
   LOGPROB_EPSILON, turn anchors of at most MAX_ANCHOR_CHARS, policy versions not newer than the learner's;
   per group of the entry (the producers publish a group whole, in one entry), exactly one baseline episode
   under advantage `remax` and none otherwise (`check_baselines`).
   One bad trajectory poisons its group and nothing else: the group's trajectories in that entry go to the
   dead-letter stream with the reason, the group is never trained on (members that come later, in other
   entries, are dropped too), the entry's other groups are kept. An entry left with nothing to train on is
   acknowledged at once.
3. Step. If `train_step` raises, or its first update meets a non-finite gradient norm (the trainer then
   applies nothing: NonFiniteUpdate), each group of the batch is probed alone with a dry-run step
   (forward and backward, no update). Groups whose probe fails are dead-lettered with its error and the
   step is trained once more on the rest; if every group failed, the step collects new ones. If no group
   fails alone, the failure is not the input's and is raised unchanged (the batch stays pending); a
   second failure of the remaining groups is raised too.

Each dead letter is counted by reason in `omrl_learner_dead_letters_total{reason}` and the run's Redis hash
`dead_letters`. A dropped group also shifts the producers' later claims, so that a replacement keeps the step
from starving, but only if it held a claim of this run: the entries it came in (the dead-lettered one, and
those of its members collected earlier or arriving later) go to GroupLeases.count_lost, which counts an entry
only if a claim published it and only once. Poison written by anyone else, entries of another run and
duplicates of a group already counted shift nothing; counted, they would make the producers play groups the
learner never asked for, each dropped as stale in the next step and counted again."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.common.config import TrainConfig
from services.common.trajectory import RecordError, Trajectory, check_invariants, encode_batch
from services.learner.advantages import ADVANTAGES
from services.learner.prometheus_metrics import DEAD_LETTERS
from services.learner.trainer import NonFiniteUpdate

log = logging.getLogger(__name__)

LOGPROB_EPSILON = 1e-4
"""A sampled token's logprob may exceed 0 by this much (float rounding in the rollout engine)."""
MAX_ANCHOR_CHARS = 64 * 1024
"""Longest anchor observation of a turn (the env service caps its own at `max_observation_chars`, 4096 by default):
GiGPO's similarity grouping compares anchors pairwise, in time quadratic in their length."""
MAX_DEAD_LETTER_PAYLOAD = 1024 * 1024
"""A dead letter keeps the rejected group's bytes up to this size (the dead-letter stream holds 1000)."""


class Poison(ValueError):
    """A trajectory the learner must not train on; `reason` is the metric label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Limits:
    vocab_size: int | None
    """Token ids must be below this; None when the trainer has no model config (tests)."""
    max_length: int
    """Most tokens in one trajectory: the context."""
    memory_length: int | None = None
    """Most tokens of one trajectory the learner's GPU memory trains (None: no limit known)."""

    @classmethod
    def for_learner(cls, config: TrainConfig, trainer: Any) -> Limits:
        """The learner model's vocabulary and context (bounded by model.max_model_len), and the longest row its
        GPU trains."""
        model_config = getattr(getattr(trainer, "model", None), "config", None)
        vocab = getattr(model_config, "vocab_size", None)
        positions = getattr(model_config, "max_position_embeddings", None)
        length = config.model.max_model_len
        memory = getattr(trainer, "max_row_tokens", None)
        return cls(int(vocab) if vocab else None, min(length, int(positions)) if positions else length, memory)


def check_trajectory(traj: Trajectory, limits: Limits, policy_version: int) -> None:
    """Raises Poison naming the first rule `traj` breaks; cheap checks that bound the later ones go first."""
    name, n = traj.trajectory_id or "?", len(traj.token_ids)
    if len(traj.loss_mask) != n or len(traj.logprobs) != n:
        raise Poison(
            "lengths",
            f"{name}: token_ids/loss_mask/logprobs lengths differ ({n}/{len(traj.loss_mask)}/{len(traj.logprobs)})",
        )
    if n > limits.max_length:
        raise Poison("too_long", f"{name}: {n} tokens exceed the learner's context of {limits.max_length}")
    if limits.memory_length is not None and n > limits.memory_length:
        raise Poison(
            "too_long",
            f"{name}: {n} tokens exceed the {limits.memory_length} that fit in the learner's GPU memory in one "
            "row (services/learner/levers.py): lower model.max_model_len, turn learner.activation_checkpointing on "
            "if it is off, or shard the learner over more GPUs",
        )
    if n and limits.vocab_size is not None and max(traj.token_ids) >= limits.vocab_size:
        raise Poison(
            "token_id", f"{name}: token id {max(traj.token_ids)} is outside the vocabulary of {limits.vocab_size}"
        )
    try:
        check_invariants(traj)
    except RecordError as exc:
        raise Poison("turns", str(exc)) from None
    if n and traj.loss_mask[0]:
        raise Poison("turns", f"{name}: a model token at position 0 has no context")
    rewards = [traj.reward, *traj.reward_components.values()]
    if not all(map(math.isfinite, rewards)):
        raise Poison(
            "non_finite", f"{name}: non-finite reward {traj.reward} (components {dict(traj.reward_components)})"
        )
    if not all(math.isfinite(turn.env_reward) and math.isfinite(turn.process_reward) for turn in traj.turns):
        raise Poison("non_finite", f"{name}: non-finite turn reward")
    if not all(map(math.isfinite, traj.logprobs)):
        raise Poison("non_finite", f"{name}: non-finite logprob")
    if n and max(traj.logprobs) > LOGPROB_EPSILON:
        raise Poison("logprob", f"{name}: logprob {max(traj.logprobs)} > 0")
    longest = max((len(t.anchor) for t in traj.turns), default=0)
    if longest > MAX_ANCHOR_CHARS:
        raise Poison("anchor", f"{name}: a turn's anchor observation of {longest} chars exceeds {MAX_ANCHOR_CHARS}")
    newest = max((t.policy_version for t in traj.turns), default=0)
    if newest > policy_version:
        raise Poison("version", f"{name}: sampled by policy v{newest}, newer than the learner's v{policy_version}")


def check_baselines(group_id: str, members: list[Trajectory], expected: int) -> None:
    """Raises Poison unless `expected` (1 under `remax`, else 0) of a group's members are baseline episodes."""
    found = sum(t.baseline for t in members)
    if found != expected:
        raise Poison("baseline", f"group {group_id}: {found} baseline episode(s), the estimator needs {expected}")


class PoisonGuard:
    """Applies the module's policy for one LearnerService. `state` and `stream` are rank 0's (None on the
    other ranks, which drop the same groups but write nothing)."""

    def __init__(self, config: TrainConfig, trainer: Any, state: Any = None, stream: Any = None):
        self.limits = Limits.for_learner(config, trainer)
        self.baselines = int(ADVANTAGES.get(config.algorithm.advantage).needs_baseline)
        self.state, self.stream = state, stream
        self.poisoned: set[str] = set()
        self._entries_of: dict[str, list[str]] = {}  # group -> entries it came in, for step-time dead letters
        if stream is not None and hasattr(stream, "on_dead_letter"):
            stream.on_dead_letter = self._count

    # -- collect time --------------------------------------------------------------------------
    def admit(self, entry: Any, policy_version: int) -> list[Trajectory]:
        """The trajectories of `entry` that may be trained on; dead-letters its poisoned groups."""
        bad: dict[str, Poison] = {}
        if any(t.group_id in self.poisoned for t in entry.batch.trajectories):
            self._count_lost([entry.entry_id])  # a member of a poisoned group, as lost as the rest of it
        for traj in entry.batch.trajectories:
            if traj.group_id in bad or traj.group_id in self.poisoned:
                continue
            try:
                check_trajectory(traj, self.limits, policy_version)
            except Poison as exc:
                bad[traj.group_id] = exc
        groups: dict[str, list[Trajectory]] = {}
        for traj in entry.batch.trajectories:
            groups.setdefault(traj.group_id, []).append(traj)
        for group_id, members in groups.items():
            if group_id not in bad and group_id not in self.poisoned:
                try:
                    check_baselines(group_id, members, self.baselines)
                except Poison as exc:
                    bad[group_id] = exc
        kept = [t for t in entry.batch.trajectories if t.group_id not in bad and t.group_id not in self.poisoned]
        for group_id, exc in bad.items():
            members = [t for t in entry.batch.trajectories if t.group_id == group_id]
            self._dead_letter(entry.entry_id, exc.reason, str(exc), group_id, members, ack=not kept)
        for traj in kept:
            ids = self._entries_of.setdefault(traj.group_id, [])
            if entry.entry_id not in ids:
                ids.append(entry.entry_id)
        return kept

    def purge(self, step: Any) -> None:
        """Drops from a collected step the members of groups poisoned after they were collected."""
        if step.groups & self.poisoned:
            step.trajectories[:] = [t for t in step.trajectories if t.group_id not in self.poisoned]
            step.groups -= self.poisoned

    # -- train time ------------------------------------------------------------------------------
    def train(self, trainer: Any, step: Any) -> dict[str, float] | None:
        """`trainer.train_step` on the step's trajectories, isolating the groups that make it fail; None
        when every group of the step failed (the caller collects again). Removes them from `step`."""
        try:
            return self._trained(trainer.train_step(step.trajectories))
        except Exception as exc:  # noqa: BLE001 - any failure is probed per group below
            failure = exc
        culprits: dict[str, BaseException] = {}
        for group_id in dict.fromkeys(t.group_id for t in step.trajectories):
            try:
                trainer.probe_step([t for t in step.trajectories if t.group_id == group_id])
            except Exception as exc:  # noqa: BLE001
                culprits[group_id] = exc
        if not culprits:
            log.error("step failed on the whole batch but on no group alone; not an input fault: %r", failure)
            raise failure
        for group_id, exc in culprits.items():
            reason = "non_finite_update" if isinstance(exc, NonFiniteUpdate) else "train_error"
            entries = self._entries_of.pop(group_id, [])
            shared = {e for g, ids in self._entries_of.items() if g not in culprits for e in ids}
            self._dead_letter(
                ",".join(entries),
                reason,
                f"{type(exc).__name__}: {exc}",
                group_id,
                [t for t in step.trajectories if t.group_id == group_id],
                ack=False,
            )
            if self.stream is not None:  # entries with a group still to be trained are acked with its checkpoint
                self.stream.ack([e for e in entries if e not in shared])
        step.trajectories[:] = [t for t in step.trajectories if t.group_id not in culprits]
        step.groups -= set(culprits)
        if not step.trajectories:
            return None
        return self._trained(trainer.train_step(step.trajectories))

    def _trained(self, stats: dict[str, float]) -> dict[str, float]:
        self._entries_of.clear()  # every group admitted so far was in this step (trained, stale or dropped)
        return stats

    # -- dead letters and counts ------------------------------------------------------------------
    def _dead_letter(
        self, entry_id: str, reason: str, error: str, group_id: str, members: Iterable[Trajectory], *, ack: bool
    ) -> None:
        self.poisoned.add(group_id)
        if self.stream is None:  # not rank 0
            return
        payload = encode_batch(members, batch_id=group_id)
        extra = {b"batch": payload} if len(payload) <= MAX_DEAD_LETTER_PAYLOAD else {b"payload_omitted": len(payload)}
        self.stream.dead_letter(entry_id, reason, error, [group_id], extra=extra, ack=ack)

    def _count(self, entry_id: str, reason: str, groups: list[str]) -> None:
        """After each dead letter (`entry_id`: the entries it came in, comma-separated)."""
        letters = max(len(groups), 1)  # an unreadable entry holds one group as the producers write them
        DEAD_LETTERS.labels(reason=reason).inc(letters)
        if self.state is not None:
            self.state.add_dead_letter(reason, letters)
        earlier = (e for group_id in groups for e in self._entries_of.get(group_id, ()))
        self._count_lost([*entry_id.split(","), *earlier])

    def _count_lost(self, entry_ids: Iterable[str]) -> None:
        """Lost groups shift later claims only for entries a claim published (see the module)."""
        if self.state is not None:
            self.state.leases.count_lost(e for e in entry_ids if e)
