"""Fused LM head + per-token logprob + entropy over vocabulary chunks.

`head_token_stats(hidden [N, d], weight [V, d], bias, targets [N])` -> (logprobs [N], entropies [N]), both
float32, equal (to float rounding) to log_softmax(hidden @ weight.T + bias) at the targets and its entropy.
One autograd node for the whole head: the forward pass computes each chunk's logits (a matmul in the
weight's dtype), then the logsumexp, the target logit and the entropy in one float32 pass over the chunk,
and keeps only the inputs and two floats a token (logsumexp, entropy). The backward pass recomputes a
chunk's logits (or, with `keep_logits`, takes the forward pass's: one matmul of the head fewer for
[tokens, V] of memory in the weight's dtype until the backward pass) and forms the logits' gradient
analytically,

    dL/dz = g_lp * (onehot(target) - p) - g_ent * p * (log p + H),   p = softmax(z), H = -sum p log p,

then the two matmuls of the head's backward. No [N, V] tensor outlives its chunk, and neither pass runs
autograd over the [chunk, V] elementwise ops. The elementwise parts are plain functions so that
torch.compile can fuse each into a few kernels (`compiled=True`); on CUDA they are Triton kernels
(`head_kernel`, one read of the logits each) unless `kernel` is `torch`."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F


def _stats(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return lse, logp, torch.zeros_like(logp)
    p = torch.exp(z - lse.unsqueeze(-1))
    return lse, logp, lse - (p * z).sum(-1)


def _softmax_grad(logits, lse, ent, g_lp, g_ent):
    """The gradient of (target logprob, entropy) at the logits, without the target's own term."""
    z = logits.float()
    log_p = z - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    if g_ent is None:
        return z, -p * g_lp.unsqueeze(-1)
    return z, -p * (g_lp.unsqueeze(-1) + g_ent.unsqueeze(-1) * (log_p + ent.unsqueeze(-1)))


def _logits_grad(logits, targets, lse, ent, g_lp, g_ent, out_dtype: torch.dtype):
    _, grad = _softmax_grad(logits, lse, ent, g_lp, g_ent)
    return grad.scatter_add(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1)).to(out_dtype)


def _logits_grad_pointwise(logits, targets, lse, ent, g_lp, g_ent, out_dtype: torch.dtype):
    """`_logits_grad` with the target's term added where the column index equals the target instead of by a
    scatter: under torch.compile one pointwise kernel that writes the gradient in `out_dtype` (the scatter made
    inductor write the float32 [chunk, V] gradient, scatter into it, then cast it in a second pass)."""
    z, grad = _softmax_grad(logits, lse, ent, g_lp, g_ent)
    is_target = torch.arange(z.shape[-1], device=z.device) == targets.unsqueeze(-1)
    return torch.where(is_target, grad + g_lp.unsqueeze(-1), grad).to(out_dtype)


KERNELS = ("auto", "triton", "torch")
_log = logging.getLogger(__name__)
_triton_broken: list[str] = []  # why the Triton kernels failed in this process, once they have


def _triton_broke(exc: Exception, fallback) -> None:
    if fallback is None or isinstance(exc, torch.OutOfMemoryError):
        raise exc
    _triton_broken.append(repr(exc))
    _log.warning("fused head: the Triton kernels failed (%s); using the torch formulation from now on", exc)


def _triton_stats(logits, targets, with_entropy: bool, fallback=None):
    try:
        from services.learner import head_kernel

        lse, logp, ent = head_kernel.stats(logits, targets)
    except Exception as exc:
        _triton_broke(exc, fallback)
        return fallback(logits, targets, with_entropy)
    return lse, logp, ent if with_entropy else torch.zeros_like(logp)


def _triton_grad(logits, targets, lse, ent, g_lp, g_ent, out_dtype: torch.dtype, fallback=None):
    try:
        from services.learner import head_kernel

        return head_kernel.logits_grad(logits, targets, lse, ent, g_lp, g_ent, out_dtype)
    except Exception as exc:
        _triton_broke(exc, fallback)
        return fallback(logits, targets, lse, ent, g_lp, g_ent, out_dtype)


def _elementwise(kernel: str, compiled: bool, device: torch.device):
    """(stats, logits_grad) for a head on `device`. `kernel` `auto`: the Triton kernels on CUDA where they build
    (a failure is logged once, then the torch formulation for the rest of the process); `triton`: always (a
    failure raises); `torch`: the torch formulation (compiled with `compiled`). `head_token_stats` has checked
    `kernel`."""
    torch_fns = _kernels(compiled)
    if kernel == "torch" or (kernel == "auto" and (device.type != "cuda" or _triton_broken)):
        return torch_fns
    stats_fallback, grad_fallback = torch_fns if kernel == "auto" else (None, None)
    return (
        functools.partial(_triton_stats, fallback=stats_fallback),
        functools.partial(_triton_grad, fallback=grad_fallback),
    )


@functools.cache
def _kernels(compiled: bool):
    """The elementwise functions, compiled once per process when asked (shapes vary: the last chunk is shorter,
    packed micro-batches have any length), so every head of the process shares the compiled graphs. Eager
    keeps the scatter (no [chunk, V] index mask); compiled takes the pointwise form (one kernel)."""
    if not compiled:
        return _stats, _logits_grad
    return (
        torch.compile(_stats, dynamic=True, fullgraph=True),
        torch.compile(_logits_grad_pointwise, dynamic=True, fullgraph=True),
    )


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, with_entropy: bool, compiled: bool, options):
        kernel, keep_logits = options
        stats, _ = _elementwise(kernel, compiled, hidden.device)
        keep = keep_logits and any(ctx.needs_input_grad[:3])
        n = hidden.shape[0]
        lse = hidden.new_empty(n, dtype=torch.float32)
        logp = torch.empty_like(lse)
        ent = torch.empty_like(lse)
        kept = []
        for start in range(0, n, chunk_tokens):
            rows = slice(start, start + chunk_tokens)
            logits = F.linear(hidden[rows], weight, bias)
            lse[rows], logp[rows], ent[rows] = stats(logits, targets[rows], with_entropy)
            if keep:
                kept.append(logits)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.chunk_tokens, ctx.with_entropy, ctx.compiled, ctx.kernel = chunk_tokens, with_entropy, compiled, kernel
        ctx.kept = kept  # not saved tensors: nothing modifies them in place, and each is dropped once used
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, []
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        _, logits_grad = _elementwise(ctx.kernel, ctx.compiled, hidden.device)
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        if not ctx.with_entropy:
            g_ent = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # the weight's gradient summed over chunks in float32: a bf16 running sum would drop low bits chunk by chunk
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b and bias is not None else None
        for i, start in enumerate(range(0, hidden.shape[0], ctx.chunk_tokens)):
            rows = slice(start, start + ctx.chunk_tokens)
            h = hidden[rows]
            logits = kept[i] if kept else F.linear(h, weight, bias)
            if kept:
                kept[i] = None
            dz = logits_grad(
                logits,
                targets[rows],
                lse[rows],
                ent[rows],
                g_lp[rows],
                None if g_ent is None else g_ent[rows],
                hidden.dtype,
            )
            del logits
            if grad_h is not None:
                grad_h[rows] = dz @ weight
            if grad_w is not None:
                grad_w += (dz.t() @ h).float()
            if grad_b is not None:
                grad_b += dz.float().sum(0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def head_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool = True,
    compiled: bool = False,
    kernel: str = "auto",
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] logprob of each target, [N] entropy, zeros unless `with_entropy`), float32. The entropy is
    differentiable only when `with_entropy`. `kernel`: the elementwise passes' implementation (`KERNELS`);
    `keep_logits`: keep each chunk's logits for the backward pass instead of recomputing them."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown head kernel {kernel!r}: one of {KERNELS}")
    options = (kernel, bool(keep_logits) and torch.is_grad_enabled())  # under no_grad nothing would use them
    return _FusedHead.apply(hidden, weight, bias, targets, max(int(chunk_tokens), 1), with_entropy, compiled, options)
