"""A reward model's batch computed once per distinct token, for causal classifiers (Hugging Face's
`GenericForSequenceClassification`: Llama, Qwen, Mistral, Gemma and the like).

- Identical inputs (episodes the policy played alike) run once.
- An input that is a prefix of another (a process reward model's turns of one episode) is read off the longer
  one's pass: with causal attention the hidden state at its last token is the same.
- Inputs that share a prefix (a group's prompt, the turns its episodes agree on) compute it once; its key/value
  cache is then copied to the rows that go on from it. A shared pass runs only where it saves at least
  `min_shared_tokens` tokens of forward, since each pass has a fixed cost (Python and kernel launches).

Each input is scored where the plain padded forward would pool it: its last token that is not the pad token.
The scores equal that forward's up to float rounding (tests/unit/test_shared_forward.py)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Row = tuple[int, ...]


def pool_position(ids: Sequence[int], pad_id: int) -> int:
    """Where a classifier reads `ids`: its last token that is not `pad_id`, 0 when every token is
    (Hugging Face's rule for a right-padded batch)."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] != pad_id:
            return i
    return 0


def common_prefix(a: Row, b: Row) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def pad_right(rows: list[list[int]], pad_id: int):
    """(input_ids, attention_mask) of `rows`, right-padded: the score head reads each row's last non-pad token."""
    import numpy as np
    import torch

    width = max(len(ids) for ids in rows)
    padded = np.full((len(rows), width), pad_id, dtype=np.int64)
    for row, ids in enumerate(rows):
        padded[row, : len(ids)] = ids  # numpy takes a list of ints ~15x faster than torch.tensor per row
    mask = (torch.arange(width) < torch.tensor([len(ids) for ids in rows])[:, None]).long()
    return torch.from_numpy(padded), mask


@dataclass
class Plan:
    """The distinct rows to run (`carriers`, sorted, none a prefix of another) and, for each input, the carrier
    and position its score is read at."""

    carriers: list[Row]
    reads: list[tuple[int, int]]
    positions: list[set[int]] = field(default_factory=list)

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]], pad_id: int) -> Plan:
        """ValueError for an input without tokens: there is nothing to read a score at."""
        if any(len(r) == 0 for r in rows):
            raise ValueError("a reward-model input has no tokens")
        unique = sorted({tuple(r) for r in rows})
        # sorted, a row's extensions follow it directly: one that is a prefix of the next is covered by a longer row
        carriers = [r for r, after in zip(unique, [*unique[1:], None]) if after is None or after[: len(r)] != r]
        reads = []
        for row in map(tuple, rows):
            at = bisect.bisect_left(carriers, row)  # the first carrier >= row: row itself or its shortest extension
            reads.append((at, pool_position(row, pad_id)))
        positions: list[set[int]] = [set() for _ in carriers]
        for at, pos in reads:
            positions[at].add(pos)
        return cls(carriers, reads, positions)

    @property
    def tokens_read(self) -> int:
        return sum(len(c) for c in self.carriers)


@dataclass
class Segment:
    """Tokens `start`.. of every row in `rows`, computed once; the rows' earlier tokens are the parent's."""

    tokens: Row
    start: int
    rows: list[int]
    parent: int | None
    depth: int


def segments(carriers: list[Row], min_shared_tokens: int) -> list[Segment]:
    """The prefix tree of the sorted `carriers`, cut where a shared span saves at least `min_shared_tokens`
    tokens of forward; every carrier's tokens lie on exactly one path of segments, parents before children."""
    out: list[Segment] = []

    def span(rows: list[int], offset: int) -> int:
        # sorted rows: what the first and last share, all share; each keeps one token of its own after it
        first, last = carriers[rows[0]], carriers[rows[-1]]
        shortest = min(len(carriers[r]) for r in rows)
        return max(0, min(common_prefix(first[offset:], last[offset:]), shortest - offset - 1))

    def worth(rows: list[int], offset: int) -> bool:
        return len(rows) > 1 and (len(rows) - 1) * span(rows, offset) >= min_shared_tokens

    def add(tokens: Row, offset: int, rows: list[int], parent: int | None) -> int:
        depth = 0 if parent is None else out[parent].depth + 1
        out.append(Segment(tokens, offset, rows, parent, depth))
        return len(out) - 1

    def node(rows: list[int], offset: int, parent: int | None) -> None:
        if worth(rows, offset):
            shared = span(rows, offset)
            parent = add(carriers[rows[0]][offset : offset + shared], offset, rows, parent)
            offset += shared
        branches: dict[int, list[int]] = {}
        for r in rows:
            branches.setdefault(carriers[r][offset], []).append(r)
        for branch in branches.values():
            if worth(branch, offset):
                node(branch, offset, parent)
            else:
                for r in branch:
                    add(carriers[r][offset:], offset, [r], parent)

    node(list(range(len(carriers))), 0, None)
    return out


class SharedForward:
    """Hidden states at a plan's positions from `base` (the classifier's transformer), each segment of the prefix
    tree computed once: one pass for each depth of the tree, its rows' caches gathered from their parents'."""

    def __init__(self, base: Any, pad_id: int, device: str, min_shared_tokens: int):
        self.base, self.pad_id, self.device, self.min_shared_tokens = base, pad_id, device, min_shared_tokens

    def run(self, plan: Plan) -> tuple[dict[tuple[int, int], Any], int]:
        """(carrier, position) -> hidden state for every position the plan reads, and the tokens the passes
        computed (padding included)."""
        import torch

        tree = segments(plan.carriers, self.min_shared_tokens)
        deepest = max(seg.depth for seg in tree)
        out: dict[tuple[int, int], Any] = {}
        computed, cache, visible, row_of = 0, None, None, {}
        for depth in range(deepest + 1):
            level = [i for i, seg in enumerate(tree) if seg.depth == depth]
            ids, mask = pad_right([list(tree[i].tokens) for i in level], self.pad_id)
            mask = mask.to(self.device).bool()
            positions = torch.tensor([tree[i].start for i in level])[:, None] + torch.arange(ids.shape[1])
            if cache is not None:
                parents = torch.tensor([row_of[tree[i].parent] for i in level], device=self.device)
                cache.reorder_cache(parents)  # each row's earlier tokens: its parent's row
                mask = torch.cat([visible[parents], mask], dim=1)
            result = self.base(
                input_ids=ids.to(self.device),
                attention_mask=mask,
                position_ids=positions.to(self.device),
                past_key_values=cache,
                use_cache=depth < deepest,
            )
            computed += ids.numel()
            cache, visible = result.past_key_values, mask
            row_of = {seg: row for row, seg in enumerate(level)}
            for row, i in enumerate(level):
                seg = tree[i]
                for r in seg.rows:
                    for pos in plan.positions[r]:
                        if seg.start <= pos < seg.start + len(seg.tokens):
                            out[(r, pos)] = result.last_hidden_state[row, pos - seg.start]
        return out, computed
