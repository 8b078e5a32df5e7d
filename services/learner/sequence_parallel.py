"""Ulysses sequence parallelism (`learner.sequence_parallel: N`): one packed row split over N processes.

DeepSpeed-Ulysses, as verl's FSDP backend runs it. The learner's processes form a data x sequence mesh
(`build_mesh`, dims ("dp", "sp"), the sequence ranks innermost, so a group of N is N consecutive ranks of one
node). The processes of a sequence group hold the same micro-batches; each packs them into one row
(`packing.pack_rows`), pads the row to a multiple of N and keeps its own contiguous 1/N of it (`split_packed`):

- token ids, and the *global* position ids of its tokens (restarting per sequence, as the whole row's), so RoPE
  rotates each token by its place in its own sequence;
- targets: each position's next token in the whole row, taken before the split, so a slice's last position
  predicts the next slice's first token;
- the whole row's sequence bounds (`cu_seqlens`, the padding one more sequence) for the attention.

Every layer runs on the slice except attention (`ulysses_attention_forward`): an all-to-all turns the slice's
[1, H, N_row/N, D] queries, keys and values into the whole row's [1, H/N, N_row, D] (a 1/N of the heads), the
varlen attention runs over the whole row within each sequence (`varlen_attention`), and a second all-to-all turns
its output back into the slice's tokens with every head. With fewer KV heads than N each is repeated (N must then
be a multiple of their count), so every process holds the KV head its query heads read.

The head (logprobs, entropy, values) runs on the slice's own tokens; `gather_sequence` assembles the row's
per-token values on every process of the group, whose backward pass keeps each process's own slice of the
gradient. Every process of the group then computes the micro-batch's loss on the same [B, T] values, so the
losses and their divisors (any aggregation, sequence-level losses included) are the unsplit code's; the
gradient a process sends back reaches the parameters only through its own tokens, and FSDP's reduction over the
whole world sums the group's parts into the unsplit gradient."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.learner.packing import PackedRows
from services.learner.varlen_attention import varlen_attention_forward

NAME = "omrl_ulysses"
"""The transformers attn_implementation of a split model: varlen attention between two all-to-alls."""
GROUP_KWARG = "sequence_group"
"""The forward kwarg that carries the `SequenceGroup` down to the attention (transformers passes kwargs through)."""
_ATTR = "_omrl_sequence_group"


@dataclass(frozen=True)
class SequenceGroup:
    """The processes that split one row: `size` of them, this one `rank` among them."""

    group: Any  # torch.distributed ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class Mesh:
    """The learner's data x sequence layout. Batches are split over the `dp` ranks; the processes of one data
    rank (a sequence group) run the same micro-batches. `dp_group` None: the whole world (no split)."""

    dp_size: int
    dp_rank: int
    dp_group: Any = None
    sequence: SequenceGroup | None = None


# -- checks (pure) --------------------------------------------------------------------------------------------


def check_world(world_size: int, sp: int) -> None:
    if sp < 1:
        raise ValueError(f"learner.sequence_parallel must be at least 1, got {sp}")
    if world_size % sp:
        raise ValueError(
            f"learner.sequence_parallel {sp} must divide the learner's {world_size} processes "
            "(each data rank is a group of that many processes)"
        )


def kv_repeats(heads: int, kv_heads: int, sp: int) -> int:
    """How many copies of each KV head the all-to-all needs: 1 when `sp` divides the KV heads, else `sp // kv`.
    Raises ValueError for a split the heads do not allow."""
    if heads % sp:
        raise ValueError(f"learner.sequence_parallel {sp} must divide the model's {heads} attention heads")
    if kv_heads % sp == 0:
        return 1
    if sp % kv_heads:
        raise ValueError(
            f"learner.sequence_parallel {sp} must divide the model's {kv_heads} key/value heads or be a multiple "
            "of them (then each is repeated)"
        )
    return sp // kv_heads


def check_model(hf_config: Any, sp: int) -> None:
    """The model's heads allow a split over `sp` (`kv_repeats`), named in the error."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text.num_attention_heads
    kv_repeats(heads, getattr(text, "num_key_value_heads", None) or heads, sp)


# -- the row split (pure) -------------------------------------------------------------------------------------


def padded_length(tokens: int, sp: int) -> int:
    """`tokens` rounded up to a multiple of `sp` (at least `sp`: every process holds one token or more)."""
    return max(-(-tokens // sp), 1) * sp


@dataclass
class RowShard:
    """One process's slice of a packed row of `tokens` real tokens padded to `size` equal slices."""

    input_ids: torch.Tensor  # [1, L] the slice's token ids
    position_ids: torch.Tensor  # [1, L] their positions in their own sequences (global, not slice-local)
    targets: torch.Tensor  # [1, L] each position's next token in the whole padded row (the last: a placeholder)
    cu_seqlens: torch.Tensor  # int32 [S + 1] the whole padded row's sequence bounds (the padding one sequence)
    max_len: int
    tokens: int
    size: int
    rank: int

    def attention_kwargs(self, group: SequenceGroup) -> dict:
        cu, n = self.cu_seqlens, self.max_len
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": n, "max_length_k": n, GROUP_KWARG: group}

    def merge(self, gathered: torch.Tensor) -> torch.Tensor:
        """The whole padded row's per-position outputs ([1, size * L], position p about token p + 1) -> [1, tokens]
        aligned as the packed row's (position t about token t, read from position t - 1; position 0 gets 0)."""
        return F.pad(gathered[:, : self.tokens - 1], (1, 0))


def split_packed(rows: PackedRows, sp: int, rank: int, pad_id: int = 0) -> RowShard:
    """`rank`'s slice of `rows` padded to a multiple of `sp` with `pad_id` tokens, which form one more sequence
    (positions from 0) that no real token attends to."""
    ids, positions = rows.input_ids.reshape(-1), rows.position_ids.reshape(-1)
    tokens = ids.numel()
    total = padded_length(tokens, sp)
    pad = total - tokens
    ids = F.pad(ids, (0, pad), value=pad_id)
    positions = torch.cat([positions, torch.arange(pad, dtype=positions.dtype, device=positions.device)])
    cu = rows.cu_seqlens.to(torch.int32)
    if pad:
        cu = torch.cat([cu, cu.new_tensor([total])])
    targets = F.pad(ids[1:], (0, 1), value=pad_id)  # shifted on the whole row, before the split
    part = slice(rank * (total // sp), (rank + 1) * (total // sp))
    return RowShard(
        input_ids=ids[part][None],
        position_ids=positions[part][None],
        targets=targets[part][None],
        cu_seqlens=cu,
        max_len=max(rows.max_len, pad),
        tokens=tokens,
        size=sp,
        rank=rank,
    )


# -- collectives ----------------------------------------------------------------------------------------------


def to_exchange(x: torch.Tensor, n: int, scatter_dim: int) -> torch.Tensor:
    """[..] -> [n, ..]: entry i is the part of `x` (along `scatter_dim`) that process i receives."""
    return torch.stack(x.chunk(n, dim=scatter_dim))


def from_exchange(received: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """[n, ..] (entry j from process j) -> the parts joined along `gather_dim` in process order."""
    return torch.cat(received.unbind(0), dim=gather_dim)


def all_to_all(x: torch.Tensor, group: SequenceGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Scatters `x` along `scatter_dim` over the group and gathers the parts it receives along `gather_dim`; the
    backward pass is the opposite all-to-all (torch's functional collective with autograd)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    parts = to_exchange(x, group.size, scatter_dim)
    received = all_to_all_single_autograd(parts, None, None, group.group)
    return from_exchange(received, gather_dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
        ctx.rank, ctx.width = group.rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(group.size)]
        dist.all_gather(parts, x.contiguous(), group=group.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = ctx.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def gather_sequence(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[.., L] per-token values of this process's slice -> [.., size * L] the whole row's, on every process of
    the group. Backward: this process's slice of the gradient, unreduced: every process of the group computes the
    same loss from the gathered values, so each passes back exactly the gradient of its own tokens."""
    return _GatherSequence.apply(x, group)


# -- the attention --------------------------------------------------------------------------------------------


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, L, D], key/value [1, Hkv, L, D] of this process's slice -> ([1, L, Hq, D], None): attention
    over the whole row (its bounds in the kwargs, `RowShard.attention_kwargs`) on Hq / size heads at a time.
    Without a group in the kwargs (a forward pass of the unsplit row) it is the varlen attention."""
    group: SequenceGroup | None = kwargs.pop(GROUP_KWARG, None)
    if group is None or group.size == 1:
        return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)
    repeats = kv_repeats(query.shape[1], key.shape[1], group.size)
    if repeats > 1:
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))
    q, k, v = (all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    out, _ = varlen_attention_forward(module, q, k, v, None, **kwargs)  # [1, N, H / size, D]
    return all_to_all(out, group, scatter_dim=1, gather_dim=2), None


def _no_mask(*args, **kwargs) -> None:
    return None


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, ulysses_attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
    return NAME


# -- the mesh and the model -----------------------------------------------------------------------------------


def build_mesh(device_type: str, world_size: int, rank: int, sp: int) -> Mesh:
    """Collective when `sp` > 1: the ("dp", "sp") device mesh's groups. `sp` 1: the world is the data group."""
    check_world(world_size, sp)
    if sp == 1:
        return Mesh(world_size, rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // sp, sp), mesh_dim_names=("dp", "sp"))
    sequence = SequenceGroup(mesh["sp"].get_group(), sp, mesh.get_local_rank("sp"))
    return Mesh(world_size // sp, mesh.get_local_rank("dp"), mesh["dp"].get_group(), sequence)


def attach(model: torch.nn.Module, group: SequenceGroup | None) -> None:
    """The model's packed forward passes split their rows over `group` (`model.token_logprobs` reads it)."""
    setattr(model, _ATTR, group if group is not None and group.size > 1 else None)


def group_of(model: torch.nn.Module) -> SequenceGroup | None:
    return getattr(model, _ATTR, None)
