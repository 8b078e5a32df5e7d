"""GiGPO (Group-in-Group Policy Optimization, Feng et al., NeurIPS 2025): GRPO's episode-level advantage plus a
step-level one from anchor-state groups.

Episode level: each trajectory's score (the sum of its token rewards, less the invalid-action penalty of each of its
turns) against its task group. Step level: within one task group, the turns of any of its episodes that acted from
the same environment state (equal anchor observations; or, with `anchor_similarity` < 1, similar ones) form an
anchor group, and each turn's discounted return G_t = sum_k gamma^(k-t) r_k over the rest of its episode is
normalised within that group; r_k is the env's reward for turn k, its process reward, or both (`step_reward`). A
turn's model tokens get A_episode + step_weight * A_step. A group of one member (a task played once, a state met
once) contributes 0 at its level; tasks never share an anchor group."""

from __future__ import annotations

import difflib
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

import torch

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs, Turns, sequence_scores


@ADVANTAGES.register("gigpo")
class GiGPO(AdvantageEstimator):
    name = "gigpo"
    needs_turns = True

    def __init__(
        self,
        *,
        step_weight: float = 1.0,
        norm: Literal["mean_norm", "mean_std_norm"] = "mean_norm",
        episode_stats: Literal["steps", "episodes"] = "steps",
        gamma: float = 0.95,
        anchor_similarity: float = 1.0,
        invalid_action_penalty: float = 0.0,
        step_reward: Literal["env", "process", "env+process"] = "env+process",
        eps: float = 1e-6,
    ):
        self.step_weight, self.use_std, self.per_step = step_weight, norm == "mean_std_norm", episode_stats == "steps"
        self.gamma, self.anchor_similarity, self.eps = gamma, anchor_similarity, eps
        self.penalty, self.step_reward = invalid_action_penalty, step_reward
        self._metrics: dict[str, float] = {}

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> GiGPO:
        return cls(
            step_weight=config.gigpo_step_weight,
            norm=config.gigpo_norm,
            episode_stats=config.gigpo_episode_stats,
            gamma=config.gigpo_gamma,
            anchor_similarity=config.gigpo_anchor_similarity,
            invalid_action_penalty=config.gigpo_invalid_action_penalty,
            step_reward=config.gigpo_step_reward,
        )

    def compute(self, inputs: AdvantageInputs) -> torch.Tensor:
        turns = inputs.turns
        if turns is None:
            raise ValueError("gigpo needs the batch's turns (AdvantageInputs.turns)")
        mask = inputs.response_mask.to(inputs.token_rewards.dtype)
        penalties = self.penalty * turns.invalid.to(mask.dtype)
        rows = mask.shape[0]
        scores = sequence_scores(inputs.token_rewards, mask) - mask.new_zeros(rows).index_add_(0, turns.row, penalties)
        # verl-agent's default: a row per turn, so a K-turn episode weighs K times in its group's mean and std
        weights = torch.bincount(turns.row, minlength=rows).to(mask.dtype) if self.per_step else torch.ones_like(scores)
        episode = group_normalised(scores, inputs.group_index, weights, use_std=self.use_std, eps=self.eps)
        groups = anchor_groups(turns.anchor, inputs.group_index[turns.row].tolist(), self.anchor_similarity)
        returns = turn_returns(self._turn_rewards(turns).to(mask.dtype) - penalties, turns.row, self.gamma)
        step = group_normalised(returns, groups, torch.ones_like(returns), use_std=self.use_std, eps=self.eps)
        self._metrics = _metrics(groups, step)
        return (episode.unsqueeze(-1) + self.step_weight * on_turn_tokens(step, turns, mask)) * mask

    def _turn_rewards(self, turns: Turns) -> torch.Tensor:
        process = turns.process if turns.process is not None else torch.zeros_like(turns.reward)
        return {"env": turns.reward, "process": process, "env+process": turns.reward + process}[self.step_reward]

    def step_metrics(self) -> dict[str, float]:
        """The share of turns in an anchor group of two or more, and the mean |A_step| over turns."""
        return dict(self._metrics)


def _metrics(groups: torch.Tensor, step: torch.Tensor) -> dict[str, float]:
    if not groups.numel():
        return {"gigpo/anchor_grouped_frac": 0.0, "gigpo/step_advantage_abs_mean": 0.0}
    shared = torch.bincount(groups)[groups] > 1
    return {
        "gigpo/anchor_grouped_frac": shared.double().mean().item(),
        "gigpo/step_advantage_abs_mean": step.abs().mean().item(),
    }


def group_normalised(
    values: torch.Tensor, groups: torch.Tensor, weights: torch.Tensor, *, use_std: bool, eps: float
) -> torch.Tensor:
    """[n]: each value minus its group's mean, divided by the group's std + eps with `use_std`; 0 in a group of one
    member. Mean and (unbiased) std count each value `weights` times; one of weight 0 is measured by the rest."""
    _, dense = torch.unique(groups, return_inverse=True)
    zeros = values.new_zeros(int(dense.max()) + 1 if dense.numel() else 0)
    members = zeros.index_add(0, dense, torch.ones_like(values))
    total = zeros.index_add(0, dense, weights)
    mean = torch.where(total > 0, zeros.index_add(0, dense, weights * values) / total.clamp(min=1e-30), 0.0)
    centred = values - mean[dense]
    if use_std:
        var = zeros.index_add(0, dense, weights * centred * centred) / (total - 1).clamp(min=1)
        centred = centred / (var.sqrt()[dense] + eps)
    return torch.where(members[dense] > 1, centred, torch.zeros_like(centred))


def turn_returns(rewards: torch.Tensor, row: torch.Tensor, gamma: float) -> torch.Tensor:
    """[N]: G_t = sum over the later turns k >= t of the same row of gamma^(k-t) r_k (a row's turns are consecutive)."""
    out, rows = rewards.tolist(), row.tolist()
    for i in range(len(out) - 2, -1, -1):
        if rows[i + 1] == rows[i]:
            out[i] += gamma * out[i + 1]
    return torch.tensor(out, dtype=rewards.dtype)


def anchor_groups(anchors: Sequence[str], tasks: Sequence[int], similarity: float = 1.0) -> torch.Tensor:
    """[N] group ids: turns of one task with equal anchors share a group; with `similarity` < 1 a new anchor joins the
    task's first group whose first anchor it matches this closely (difflib's ratio). An empty anchor (a state the env
    did not name) is a group of its own; turns of different tasks never share one."""
    ids: list[int] = []
    seen: dict[tuple[int, str], int] = {}
    firsts: defaultdict[int, list[tuple[str, int]]] = defaultdict(list)  # task -> (first anchor, id) of its groups
    groups = 0
    for anchor, task in zip(anchors, tasks):
        group = seen.get((task, anchor)) if anchor else None
        if group is None and anchor and similarity < 1:
            group = _similar_group(anchor, firsts[task], similarity)
        if group is None:
            group, groups = groups, groups + 1
            if anchor:
                firsts[task].append((anchor, group))
        if anchor:
            seen[(task, anchor)] = group
        ids.append(group)
    return torch.tensor(ids, dtype=torch.long)


def _similar_group(anchor: str, firsts: list[tuple[str, int]], similarity: float) -> int | None:
    for first, group in firsts:
        matcher = difflib.SequenceMatcher(None, first, anchor)
        # the quick ratios bound ratio() from above: most pairs are ruled out without its quadratic matching
        quick = matcher.real_quick_ratio() >= similarity and matcher.quick_ratio() >= similarity
        if quick and matcher.ratio() >= similarity:
            return group
    return None


def on_turn_tokens(values: torch.Tensor, turns: Turns, like: torch.Tensor) -> torch.Tensor:
    """[B, T] shaped as `like`: each turn's value on its model tokens, 0 elsewhere."""
    out = torch.zeros_like(like)
    for row, start, end, value in zip(turns.row.tolist(), turns.start.tolist(), turns.end.tolist(), values.tolist()):
        out[row, start:end] = value
    return out
