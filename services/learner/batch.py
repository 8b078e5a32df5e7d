"""Trajectory records to padded [B, T] tensors.

Alignment: every [B, T] tensor here holds, at position t, something about token t (its mask, its rollout
logprob, its reward, ...). A causal LM predicts token t from the logits at position t - 1; that shift
happens in exactly one place, `logprobs_from_logits` / `entropy_from_logits`, and nowhere else."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from services.common.trajectory import RecordError, Trajectory, check_invariants, model_segments
from services.learner.advantages.base import Turns
from services.learner.allocation import trajectory_token_rewards


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded with pad_id
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens
    response_mask: torch.Tensor  # [B, T] float, 1 on tokens the model sampled
    rollout_logprobs: torch.Tensor  # [B, T] float, sampled-token logprob under the rollout policy
    token_rewards: torch.Tensor  # [B, T] float, the allocated reward
    policy_versions: torch.Tensor  # [B, T] long, version of the weights that sampled token t (0 elsewhere)
    group_index: torch.Tensor  # [B] long, group ids as 0..G-1 in order of first appearance
    rewards: torch.Tensor  # [B] float, the trajectory reward
    success: torch.Tensor  # [B] float, 1.0 when the episode succeeded

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def trim(self) -> TrainBatch:
        """Drops the padding columns no row of this batch needs."""
        length = int(self.attention_mask.sum(-1).max()) if self.size else 0
        return replace(
            self,
            **{f.name: getattr(self, f.name)[:, :length] for f in fields(self) if getattr(self, f.name).dim() == 2},
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def used_length(traj: Trajectory) -> int:
    """Tokens of a trajectory up to its last model token. What follows (the observation after the last turn,
    which an episode that runs out of turns keeps) is never scored nor read by a scored token: a causal model's
    logprobs, entropies and values at the model tokens do not depend on it. A record without model tokens is
    kept whole (it carries no loss either way)."""
    return max((end for _, end in model_segments(traj)), default=len(traj.token_ids))


def collate(
    trajectories: Sequence[Trajectory], pad_id: int, *, allocation: str = "last_token", gamma: float = 1.0
) -> TrainBatch:
    """Rows end at their last model token (`used_length`): on one-turn tasks that run out of turns the
    trailing observation was ~40% of each row's tokens, all computed and none used."""
    if not trajectories:
        raise ValueError("collate needs at least one trajectory")
    checked = [check_invariants(traj) for traj in trajectories]
    used = [used_length(t) for t in trajectories]
    batch, length = len(trajectories), max(used)
    # rows are filled in numpy (a list assigned into an array converts in C); torch.tensor(list) per row was
    # most of a 64 x 2k-token collate, on the learner's critical path with the GPU idle
    ids = np.full((batch, length), pad_id, dtype=np.int64)
    attn = np.zeros((batch, length), dtype=np.int64)
    resp, lps, rew = (np.zeros((batch, length), dtype=np.float32) for _ in range(3))
    versions = np.zeros((batch, length), dtype=np.int64)
    groups: dict[str, int] = {}
    for i, (traj, n, (mask, logprobs)) in enumerate(zip(trajectories, used, checked)):
        if n and mask[0]:
            raise RecordError(f"{traj.trajectory_id}: a model token at position 0 has no context")
        ids[i, :n] = np.array(traj.token_ids)[:n]
        attn[i, :n] = 1
        resp[i, :n] = mask[:n]
        lps[i, :n] = logprobs[:n]
        rew[i, :n] = trajectory_token_rewards(traj, allocation, gamma)[:n]
        for turn in traj.turns:
            versions[i, turn.start : turn.start + turn.model_tokens] = turn.policy_version
        groups.setdefault(traj.group_id, len(groups))
    ids, attn, resp, lps, rew, versions = map(torch.from_numpy, (ids, attn, resp, lps, rew, versions))
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        rollout_logprobs=lps,
        token_rewards=rew,
        policy_versions=versions,
        group_index=torch.tensor([groups[t.group_id] for t in trajectories], dtype=torch.long),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        success=torch.tensor([float(t.success) for t in trajectories], dtype=torch.float32),
    )


def split_baselines(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], dict[str, Trajectory]]:
    """(the trajectories to train on, each group's baseline episode by group id): a baseline episode (advantage
    `remax`) is never a row of the batch. The poison guard admits at most one per group."""
    baselines = {t.group_id: t for t in trajectories if t.baseline}
    return [t for t in trajectories if not t.baseline], baselines


def baseline_scores(
    trajectories: Sequence[Trajectory], baselines: dict[str, Trajectory], allocation: str, gamma: float
) -> torch.Tensor:
    """[B] float64: the score of each row's group baseline episode, the sum of its allocated token rewards (as a
    row's score is). Raises RecordError for a row whose group has none."""
    scores: dict[str, float] = {}
    for group_id, traj in baselines.items():
        scores[group_id] = float(np.sum(trajectory_token_rewards(traj, allocation, gamma), dtype=np.float64))
    missing = sorted({t.group_id for t in trajectories} - scores.keys())
    if missing:
        raise RecordError(f"group(s) {', '.join(missing)} have no baseline episode")
    return torch.tensor([scores[t.group_id] for t in trajectories], dtype=torch.float64)


def turns_of(trajectories: Sequence[Trajectory]) -> Turns:
    """The turns of `collate(trajectories)`'s rows, for the estimators that read them (`needs_turns`)."""
    rows, starts, ends, rewards, process, invalid, anchors = [], [], [], [], [], [], []
    for i, traj in enumerate(trajectories):
        for turn in traj.turns:
            rows.append(i)
            starts.append(turn.start)
            ends.append(turn.start + turn.model_tokens)
            rewards.append(turn.env_reward)
            process.append(turn.process_reward)
            invalid.append(not turn.action_valid or turn.action_rejected)
            anchors.append(turn.anchor)
    return Turns(
        row=torch.tensor(rows, dtype=torch.long),
        start=torch.tensor(starts, dtype=torch.long),
        end=torch.tensor(ends, dtype=torch.long),
        reward=torch.tensor(rewards, dtype=torch.float32),
        invalid=torch.tensor(invalid, dtype=torch.bool),
        anchor=tuple(anchors),
        process=torch.tensor(process, dtype=torch.float32),
    )


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits, [B, T] ids -> [B, T]: position t = log p(token t | tokens < t); position 0 = 0."""
    logits = logits[:, :-1].float()
    picked = logits.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked - torch.logsumexp(logits, dim=-1), (1, 0))


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B, T]: position t = entropy of the distribution token t was drawn from; position 0 = 0."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.nn.functional.pad(-(logp.exp() * logp).sum(-1), (1, 0))
