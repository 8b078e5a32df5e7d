"""PPO policy and value losses, loss aggregation and KL diagnostics on [B, T] tensors; position t refers
to token t everywhere. The trainer reaches the policy loss through `policy_losses` (by name)."""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(ref || current) on tokens sampled from ref: r - 1 - log r, r = p/p_ref."""
    log_ratio = (logprobs - ref_logprobs).clamp(-20.0, 20.0)
    return torch.expm1(log_ratio) - log_ratio


def ppo_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's `ppo_kl`: the masked mean of log p_old - log p (k1 of KL(old || new); signed, detached)."""
    return masked_mean((old_logprobs - logprobs).detach(), mask)


def mismatch_kl(learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean k3 KL(rollout || learner) over the sampled (masked) tokens."""
    return masked_mean(k3_kl(learner_logprobs, rollout_logprobs), mask)


def aggregate(
    token_loss: torch.Tensor,
    mask: torch.Tensor,
    agg_mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduces [B, T] to a scalar (verl's `agg_loss`). The divisors default to this batch's own; pass the global
    batch's (`num_tokens` = masked tokens, `num_seqs` = sequences with any masked token, `loss_scale_factor` =
    seq-mean-token-sum-norm's constant, default the width T) to make the sum over micro-batches and ranks equal
    the full-batch loss. `token-sum` has no divisor: micro-batches add up as they are."""
    mask = mask.to(token_loss.dtype)
    if agg_mode == "token-mean":
        denom = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
        return (token_loss * mask).sum() / denom
    if agg_mode == "token-sum":
        return (token_loss * mask).sum()
    seq_sum = (token_loss * mask).sum(-1)
    if agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_seq = seq_sum
    elif agg_mode == "seq-mean-token-mean":
        per_seq = seq_sum / mask.sum(-1).clamp(min=1)
    else:
        raise ValueError(f"unknown loss_agg_mode {agg_mode!r}; known: {', '.join(AGG_MODES)}")
    denom = (mask.sum(-1) > 0).sum().clamp(min=1) if num_seqs is None else num_seqs
    if agg_mode == "seq-mean-token-sum-norm":
        denom = denom * (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return per_seq.sum() / denom


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    agg_mode: str = "token-mean",
    *,
    clip_ratio_c: float | None = None,
    is_weights: torch.Tensor | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with the ratio clipped to [1 - clip_low, 1 + clip_high].

    Dual-clip (`clip_ratio_c` > 1): where the advantage is negative the token loss is at most
    -A * clip_ratio_c, so a huge ratio on a bad token cannot blow up the update. `is_weights` (detached,
    e.g. truncated importance weights against the rollout policy) multiply the token losses.
    Stats (detached, means over this batch's masked tokens): clip_frac, clip_frac_lower (dual-clip
    active), approx_kl (k3 of old vs new), ppo_kl (verl's: mean log p_old - log p), ratio_mean."""
    log_ratio = (logprobs - old_logprobs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    token_loss = torch.maximum(unclipped, clipped)
    lower = torch.zeros_like(token_loss, dtype=torch.bool)
    if clip_ratio_c is not None:
        cap = -advantages * clip_ratio_c
        lower = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, cap), token_loss)
    if is_weights is not None:
        token_loss = token_loss * is_weights
    divisors = {"num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale_factor": loss_scale_factor}
    loss = aggregate(token_loss, mask, agg_mode, **divisors)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            "clip_frac_lower": masked_mean(lower.to(ratio.dtype), mask),
            "approx_kl": masked_mean(k3_kl(logprobs, old_logprobs), mask),
            "ppo_kl": ppo_kl(logprobs, old_logprobs, mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return loss, stats


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_learner / pi_rollout, cap) per token, detached: corrects for the rollout engine sampling from
    slightly different (stale, or numerically different) weights than the learner's."""
    return torch.exp((old_logprobs - rollout_logprobs).clamp(-20.0, 20.0)).clamp(max=cap).detach()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
    agg_mode: str = "token-mean",
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss: 0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).
    Stats: vf_clip_frac (the clipped branch is larger), vf_mean."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    plain, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    divisors = {"num_tokens": num_tokens, "num_seqs": num_seqs, "loss_scale_factor": loss_scale_factor}
    loss = 0.5 * aggregate(torch.maximum(plain, clipped), mask, agg_mode, **divisors)
    with torch.no_grad():
        stats = {
            "vf_clip_frac": masked_mean((clipped > plain).to(values.dtype), mask),
            "vf_mean": masked_mean(values, mask),
        }
    return loss, stats
