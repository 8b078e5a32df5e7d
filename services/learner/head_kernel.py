"""The fused head's two elementwise passes over a chunk's logits as Triton kernels, one program a row:

- `stats`: the logsumexp, the target's logprob and the entropy in one read of the row (an online softmax
  that also carries sum(exp(z - m) * z), so the entropy needs no second pass);
- `logits_grad`: the logits' gradient, written in the hidden states' dtype in one read and one write.

Both are bound by memory (a chunk's logits are [tokens, 152k] at the Qwen vocabulary). The torch
formulations in `fused_head` stay the reference, the CPU path and the fallback; compiled by Inductor as one
flat pointwise kernel, the gradient spent most of its time on the column index (a division by the
vocabulary size per element), and the statistics read each row three times."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # columns a program reads per iteration
_WARPS = 8


def stats(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp, target logprob, entropy), float32 [n], of `logits` [n, V] (read in their dtype, summed in
    float32). A target outside [0, V) gives a NaN logprob (the trainer's finite checks catch it; no host
    sync here)."""
    logits = logits.contiguous()
    n, v = logits.shape
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    logp, ent = torch.empty_like(lse), torch.empty_like(lse)
    if n:
        _stats_kernel[(n,)](logits, targets, lse, logp, ent, v, BLOCK=_BLOCK, num_warps=_WARPS)
    return lse, logp, ent


def logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    g_lp: torch.Tensor,
    g_ent: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """dL/dz = g_lp (onehot(target) - p) - g_ent p (log p + H), p = exp(z - lse), in `out_dtype`."""
    logits = logits.contiguous()
    n, v = logits.shape
    out = torch.empty((n, v), dtype=out_dtype, device=logits.device)
    if n:
        has_ent = g_ent is not None
        _grad_kernel[(n,)](
            logits,
            targets,
            lse,
            ent,
            g_lp.float().contiguous(),
            g_ent.float().contiguous() if has_ent else g_lp,
            out,
            v,
            HAS_ENT=has_ent,
            BLOCK=_BLOCK,
            num_warps=_WARPS,
        )
    return out


@triton.jit
def _stats_kernel(logits, targets, lse_out, logp_out, ent_out, v, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * v
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s0 = tl.zeros((), tl.float32)  # sum of exp(z - m)
    s1 = tl.zeros((), tl.float32)  # sum of exp(z - m) * z
    for start in range(0, v, BLOCK):
        inside = start + cols < v
        z = tl.load(base + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.where(inside, tl.exp(z - m_new), 0.0)
        s0 = s0 * scale + tl.sum(e, axis=0)
        s1 = s1 * scale + tl.sum(tl.where(inside, e * z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s0)
    target = tl.load(targets + row)
    valid = (target >= 0) & (target < v)
    picked = tl.load(base + target, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(lse_out + row, lse)
    tl.store(logp_out + row, picked - lse)
    tl.store(ent_out + row, lse - s1 / s0)


@triton.jit
def _grad_kernel(
    logits, targets, lse_in, ent_in, g_lp_in, g_ent_in, out, v, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * v
    dest = out + row * v
    cols = tl.arange(0, BLOCK)
    lse = tl.load(lse_in + row)
    g_lp = tl.load(g_lp_in + row)
    target = tl.load(targets + row)
    if HAS_ENT:
        ent = tl.load(ent_in + row)
        g_ent = tl.load(g_ent_in + row)
    for start in range(0, v, BLOCK):
        inside = start + cols < v
        log_p = tl.load(base + start + cols, mask=inside, other=0.0).to(tl.float32) - lse
        p = tl.exp(log_p)
        if HAS_ENT:  # noqa: SIM108 (a statement the JIT resolves at compile time; ent, g_ent exist only then)
            grad = -p * (g_lp + g_ent * (log_p + ent))
        else:
            grad = -p * g_lp
        grad = tl.where(start + cols == target, grad + g_lp, grad)
        tl.store(dest + start + cols, grad.to(dest.dtype.element_ty), mask=inside)
