"""Rollout correction: importance weights pi_learner / pi_rollout for tokens the rollout engine sampled from
other weights (bf16 sampling, or an older policy under `max_staleness`), and rejection of samples whose ratio
is out of bounds (verl's rollout importance sampling: `rollout_is_level`, `rollout_is_mode`,
`rollout_is_threshold`, `rollout_is_threshold_lower`, `rollout_is_veto_threshold`, `rollout_is`).

Invariants: weights are detached and 0 wherever a token is not kept; the kept mask is the response mask with the
rejected tokens set to 0 (never a token added); every token of a sequence (level `sequence`, `geometric`) or of
a model turn (level `turn`: a maximal run of consecutive model tokens) has the same ratio, so that level's
mask mode keeps or rejects it whole."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.common.config import AlgorithmConfig

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to +-this before exp, as verl does (e^20 ~ 5e8)."""

SUMS = ("tis_weight", "tis_clipped", "rollout_masked_tokens", "rollout_masked_seqs", "rollout_vetoed_seqs")
"""The per-step sums `RolloutCorrection.__call__` returns (added up over micro-batches and ranks)."""


@dataclass(frozen=True, eq=False)
class Correction:
    """One micro-batch's correction: `weights` [B, T] (None when `rollout_is` is off), `keep` [B, T] (the
    response mask less the rejected tokens; None when nothing can be rejected), `sums` (of `SUMS`, 0-dim)."""

    weights: torch.Tensor | None
    keep: torch.Tensor | None
    sums: dict[str, torch.Tensor]


def turn_ids(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] long: 1, 2, ... for the tokens of a row's first, second, ... run of consecutive masked tokens;
    0 off the mask."""
    on = mask > 0
    starts = on & ~torch.nn.functional.pad(on[:, :-1], (1, 0))
    return torch.cumsum(starts.long(), -1) * on.long()


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """[B, T]: the log-ratio of each masked token's unit at `level` (0 off the mask): the token's own, its
    sequence's sum (`sequence`) or mean (`geometric`), or its turn's mean (`turn`)."""
    m = mask.to(log_ratio.dtype)
    lr = log_ratio * m
    if level == "token":
        return lr
    if level == "sequence":
        return lr.sum(-1, keepdim=True) * m
    if level == "geometric":
        return lr.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1) * m
    if level == "turn":
        ids = turn_ids(mask)
        n = int(ids.max()) + 1 if ids.numel() else 1
        sums = torch.zeros(lr.shape[0], n, dtype=lr.dtype, device=lr.device).scatter_add_(1, ids, lr)
        counts = torch.zeros_like(sums).scatter_add_(1, ids, m)
        return (sums / counts.clamp(min=1)).gather(1, ids) * m
    raise ValueError(f"unknown rollout_is_level {level!r}; known: token, sequence, geometric, turn")


@dataclass(frozen=True)
class RolloutCorrection:
    """`cap` (tis_cap): the upper threshold, 0 turns the correction off; `lower`: the mask band's lower bound
    (None: 1 / cap); `veto`: a sequence with any token ratio below it is rejected (None: off); `apply`: the
    weights go into the loss (else only the rejection and the metrics)."""

    cap: float = 2.0
    level: str = "token"
    mode: str = "truncate"
    lower: float | None = None
    veto: float | None = None
    apply: bool = True

    @classmethod
    def from_config(cls, config: AlgorithmConfig) -> RolloutCorrection:
        return cls(
            cap=config.tis_cap,
            level=config.rollout_is_level,
            mode=config.rollout_is_mode,
            lower=config.rollout_is_threshold_lower,
            veto=config.rollout_is_veto_threshold,
            apply=config.rollout_is,
        )

    @property
    def enabled(self) -> bool:
        return self.cap > 0

    @property
    def rejects(self) -> bool:
        """Whether tokens can leave the loss (and its divisors): the mask mode, or the veto."""
        return self.enabled and (self.mode == "mask" or self.veto is not None)

    def __call__(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> Correction:
        """`old_logprobs`: the learner's (pre-update) logprobs, `rollout_logprobs` the engine's, [B, T]."""
        with torch.no_grad():
            m = mask.to(old_logprobs.dtype)
            log_ratio = (old_logprobs - rollout_logprobs) * m
            unit = level_log_ratio(log_ratio, mask, self.level)
            raw = torch.exp(unit.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
            keep = m
            if self.mode == "mask":
                lower = 1.0 / self.cap if self.lower is None else self.lower
                keep = keep * ((raw >= lower) & (raw <= self.cap)).to(m.dtype)
                weights = raw
            else:
                weights = raw.clamp(max=self.cap)
            vetoed = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
            if self.veto is not None:
                vetoed = ((log_ratio < math.log(self.veto)) & (m > 0)).any(-1)
                keep = keep * (~vetoed).unsqueeze(-1).to(m.dtype)
            weights = weights * keep
            removed = m - keep
            sums = {
                "tis_weight": (weights * keep).sum(),
                "tis_clipped": ((raw > self.cap).to(m.dtype) * m).sum(),
                "rollout_masked_tokens": removed.sum(),
                "rollout_masked_seqs": (removed.sum(-1) > 0).sum().to(m.dtype),
                "rollout_vetoed_seqs": vetoed.sum().to(m.dtype),
            }
        return Correction(weights if self.apply else None, keep if self.rejects else None, sums)

    def metrics(self, sums: dict[str, float], tokens: float, seqs: float) -> dict[str, float]:
        """The step's metrics from its `SUMS` over the batch's `tokens` model tokens in `seqs` sequences:
        tis_weight_mean (over the tokens the loss keeps), tis_clip_frac (share of tokens whose ratio is above the
        cap: cut, or rejected by the mask mode), and with rejection the shares and counts of rejected tokens,
        sequences (any token rejected) and vetoed sequences."""
        if not self.enabled:
            return {}
        masked = sums["rollout_masked_tokens"]
        out = {
            "tis_weight_mean": sums["tis_weight"] / max(tokens - masked, 1.0),
            "tis_clip_frac": sums["tis_clipped"] / max(tokens, 1.0),
        }
        if self.rejects:
            out.update(
                rollout_is_masked_fraction=masked / max(tokens, 1.0),
                rollout_is_seq_masked_fraction=sums["rollout_masked_seqs"] / max(seqs, 1.0),
                rollout_is_veto_fraction=sums["rollout_vetoed_seqs"] / max(seqs, 1.0),
                rollout_is_masked_tokens=masked,
                rollout_is_masked_seqs=sums["rollout_masked_seqs"],
            )
        return out
