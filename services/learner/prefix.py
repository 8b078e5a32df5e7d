"""Shared prompts: a group's sequences (GRPO's `group_size` samples of one task) start with the same prompt
tokens, which a padded forward pass computes once per sequence. With `learner.share_prefix` the decoder runs
each group's common prefix once, repeats its key/value cache over the group's rows and runs only the rows'
own tokens on top of it; autograd sums the rows' gradients into the one prefix pass. The hidden states, and
so the logprobs and gradients, are those of the padded pass up to float rounding.

The saving is the prefix's share of the tokens times (group size - 1) / group size: on the vs_trl batch
(59-token prompt, 16 sampled tokens, 8 per group) 69% of the decoder's tokens.

Invariants of a `Prefix`: at least two rows, all with identical real tokens at positions 0..length-1, and
every row has at least one real token after them (the row's own part is never empty)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Prefix:
    rows: tuple[int, ...]
    """Rows of the (micro-)batch that share the prefix, in order."""
    length: int
    """Tokens they share, from position 0."""


def shared_prefixes(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, group_index: torch.Tensor, min_tokens: int = 1
) -> list[Prefix]:
    """The rows of each group (same `group_index`) of two or more rows, with the longest prefix of real tokens
    they all share, capped so that every row keeps at least one token of its own; groups that share fewer
    than `min_tokens` are left out (their rows run as they are)."""
    lengths = attention_mask.sum(-1).tolist()
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(group_index.tolist()):
        groups.setdefault(group, []).append(row)
    out = []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        cap = min(lengths[r] for r in rows) - 1
        if cap < min_tokens:
            continue
        ids = input_ids[rows, :cap]
        same = (ids == ids[:1]).all(0)  # [cap] True where every row has the first row's token
        length = int(same.long().cumprod(0).sum())
        if length >= min_tokens:
            out.append(Prefix(tuple(rows), length))
    return out


def group_ordered(trajectories: Sequence[T]) -> list[T]:
    """The trajectories with each group's rows together (groups in order of first appearance, rows in order
    within a group): a batch collected as episodes finish interleaves its groups, and consecutive micro-batches
    then split each group into pieces that share their prompt only among themselves."""
    first: dict[str, int] = {}
    for t in trajectories:
        first.setdefault(t.group_id, len(first))
    return sorted(trajectories, key=lambda t: first[t.group_id])


def decoder_tokens(width: int, rows: int, prefixes: list[Prefix]) -> int:
    """Token positions the decoder runs for a [rows, width] micro-batch with these prefixes (padding included)."""
    shared = sum(len(p.rows) for p in prefixes)
    return (rows - shared) * width + sum(p.length + len(p.rows) * (width - p.length) for p in prefixes)


def shared_prefix_hidden(
    decoder: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefixes: list[Prefix]
) -> torch.Tensor:
    """[B, T, H] last hidden states of a right-padded batch, each prefix's tokens computed once (its rows'
    states there are views of the one pass). Rows outside every prefix run as one padded pass."""
    b, t = input_ids.shape
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for p in prefixes:
        rows = torch.tensor(p.rows, device=input_ids.device)
        head = decoder(input_ids=input_ids[p.rows[0] : p.rows[0] + 1, : p.length], use_cache=True)
        cache = head.past_key_values
        cache.batch_repeat_interleave(len(p.rows))
        positions = torch.arange(p.length, t, device=input_ids.device).expand(len(p.rows), -1)
        own = decoder(
            input_ids=input_ids[rows, p.length :],
            attention_mask=attention_mask[rows],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
        parts.append(torch.cat([head.last_hidden_state.expand(len(p.rows), -1, -1), own], dim=1))
        order.extend(p.rows)
    rest = sorted(set(range(b)) - set(order))
    if rest:
        rows = torch.tensor(rest, device=input_ids.device)
        parts.append(
            decoder(input_ids=input_ids[rows], attention_mask=attention_mask[rows], use_cache=False).last_hidden_state
        )
        order.extend(rest)
    inverse = torch.empty(b, dtype=torch.long, device=input_ids.device)
    inverse[torch.tensor(order, device=input_ids.device)] = torch.arange(b, device=input_ids.device)
    return torch.cat(parts)[inverse]
