"""Attention over packed rows without cross-document work (`learner.attention: varlen`).

With sdpa, a packed row of N tokens gets an [N, N] block-diagonal mask and the kernel computes all N^2
scores: on 16k-token rows of 256..2,048-token documents that is ~13x the attention work the documents need
(measured: attention was 57% of the learner's GPU time). Here each document attends only to itself: torch's
varlen flash kernel on CUDA in half precision, one causal SDPA call per document elsewhere. The document
boundaries come from `PackedRows` as cumulative lengths, passed through the model's forward kwargs, so no
mask tensor is ever built."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

NAME = "omrl_varlen"
"""The transformers attn_implementation it is registered under."""


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


def _no_mask(*args, **kwargs) -> None:
    return None


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, N, D], key/value [1, Hkv, N, D] -> ([1, N, Hq, D], None), as transformers' sdpa returns."""
    if query.shape[0] != 1 or cu_seq_lens_q is None or max_length_q is None:
        raise ValueError("varlen attention takes packed rows only: set learner.pack_sequences")
    if dropout:
        raise ValueError("varlen attention has no dropout (the learner trains in eval mode)")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        out = _flash(q, k, v, cu_seq_lens_q.to(torch.int32), int(max_length_q), scaling)
    else:
        out = _per_document(q, k, v, cu_seq_lens_q.tolist(), scaling)
    return out[None], None


def _per_document(q, k, v, bounds: list[int], scale) -> torch.Tensor:
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        if end > start:
            qd, kd, vd = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, n, D]
            out = F.scaled_dot_product_attention(
                qd, kd, vd, is_causal=True, scale=scale, enable_gqa=kd.shape[1] != qd.shape[1]
            )
            parts.append(out[0].transpose(0, 1))
    return torch.cat(parts) if parts else q.new_zeros(q.shape)


def _flash(q, k, v, cu: torch.Tensor, max_len: int, scale) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    options: dict = {"scale": scale}
    if "is_causal" in params:  # its signature changed between torch releases
        options["is_causal"] = True
    else:
        options["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            options["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **options)
