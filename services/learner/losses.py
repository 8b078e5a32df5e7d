"""PPO policy loss and KL estimators on [B, T] tensors; position t refers to token t everywhere."""
from __future__ import annotations

from typing import Optional

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(ref || current) on tokens sampled from ref: r - 1 - log r, r = p/p_ref."""
    log_ratio = (logprobs - ref_logprobs).clamp(-20.0, 20.0)
    return torch.expm1(log_ratio) - log_ratio


def mismatch_kl(learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean k3 KL(rollout || learner) over the sampled (masked) tokens."""
    return masked_mean(k3_kl(learner_logprobs, rollout_logprobs), mask)


def aggregate(token_loss: torch.Tensor, mask: torch.Tensor, agg_mode: str, *,
              num_tokens: Optional[float] = None, num_seqs: Optional[float] = None) -> torch.Tensor:
    """Reduces [B, T] to a scalar. The divisors default to this batch's own; pass the global batch's
    (`num_tokens` = masked tokens, `num_seqs` = sequences with any masked token) to make the sum over
    micro-batches and ranks equal the full-batch loss."""
    mask = mask.to(token_loss.dtype)
    if agg_mode == "token-mean":
        denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return (token_loss * mask).sum() / denom
    seq_sum = (token_loss * mask).sum(-1)
    if agg_mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif agg_mode == "seq-mean-token-mean":
        per_seq = seq_sum / mask.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"unknown loss_agg_mode {agg_mode!r}; known: {', '.join(AGG_MODES)}")
    denom = (mask.sum(-1) > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    return per_seq.sum() / denom


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float, clip_high: float, agg_mode: str = "token-mean", *,
                num_tokens: Optional[float] = None, num_seqs: Optional[float] = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with the ratio clipped to [1 - clip_low, 1 + clip_high].

    Stats (detached, means over this batch's masked tokens): clip_frac, approx_kl (k3), ratio_mean."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    loss = aggregate(token_loss, mask, agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "approx_kl": masked_mean(k3_kl(logprobs, old_logprobs), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats
