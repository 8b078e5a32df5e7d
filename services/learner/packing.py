"""Sequence packing: the real tokens of a right-padded [B, T] micro-batch as one [1, N] row, positions
restarting at each sequence, so the model computes nothing on padding. With no attention mask and such
position ids, transformers attends within each sequence only (a block-diagonal causal mask for sdpa and
eager, varlen kernels for flash attention, a document mask for flex attention).

Per-token outputs come back to the [B, T] layout with `unpack`, so everything after the forward pass (the
losses, advantages, masks) is the same code with or without packing."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [1, N] the real tokens, row after row
    position_ids: torch.Tensor  # [1, N] 0..len-1 within each row
    index: torch.Tensor  # [N] where each packed token sits in the flattened [B, T]
    shape: tuple[int, int]
    cu_seqlens: torch.Tensor  # [B + 1] int32 where each row's tokens start in the packed row, then N
    max_len: int

    def attention_kwargs(self) -> dict:
        """The document bounds in the forward kwargs varlen kernels read (`varlen_attention`, flash attention)."""
        cu, n = self.cu_seqlens, self.max_len
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": n, "max_length_k": n}

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """[1, N] per-token values, aligned as the unpacked ones (position t = about token t, read from the
        output at t - 1), -> [B, T]. The first token of each sequence gets 0: in the packed row its
        predecessor belongs to the previous sequence."""
        flat = values.reshape(-1) * (self.position_ids.reshape(-1) != 0)
        out = flat.new_zeros(self.shape[0] * self.shape[1])
        return out.index_put((self.index,), flat).reshape(self.shape)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """`attention_mask` must be 1 on a prefix of each row (right padding), as `collate` builds it."""
    b, t = input_ids.shape
    real = attention_mask.bool()
    index = real.reshape(-1).nonzero().squeeze(-1)
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    lengths = real.sum(1)
    return PackedRows(
        input_ids=input_ids.reshape(-1)[index][None],
        position_ids=positions[real][None],
        index=index,
        shape=(b, t),
        cu_seqlens=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32),
        max_len=int(lengths.max()) if b else 0,
    )


def token_budget_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows grouped so that each group's total length stays within `budget` tokens (a longer row
    alone); verl's dynamic batch size. Returns the row positions of each group."""
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not groups or used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups
