"""Sequence parallelism's pure parts, without a process group: the row split (padding, global positions, targets
shifted before the split, the whole row's bounds), putting the gathered values back, the all-to-all's layout (its
exchange simulated), the head checks, the config's refusals and the levers it sets. The collectives themselves:
tests/integration/test_sequence_parallel_two_procs.py."""

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from services.common.config import LearnerConfig
from services.learner import levers
from services.learner.packing import pack_rows
from services.learner.sequence_parallel import (
    check_model,
    check_world,
    from_exchange,
    kv_repeats,
    padded_length,
    split_packed,
    to_exchange,
)
from tests.support.learner import make_config


def _packed(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, t = len(lengths), max(lengths)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).long()
    return pack_rows(torch.randint(3, 64, (b, t), generator=gen) * mask, mask)


@pytest.mark.parametrize(("tokens", "sp", "expected"), [(25, 2, 26), (24, 2, 24), (25, 4, 28), (1, 2, 2), (0, 3, 3)])
def test_padded_length_is_the_next_multiple_and_never_empty(tokens, sp, expected):
    assert padded_length(tokens, sp) == expected


@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("lengths", [(6, 1, 9, 5, 4), (8, 8), (1,), (3, 2)])
def test_the_slices_join_into_the_padded_row(lengths, sp):
    rows = _packed(lengths)
    n = sum(lengths)
    total = padded_length(n, sp)
    shards = [split_packed(rows, sp, rank, pad_id=0) for rank in range(sp)]
    ids = torch.cat([s.input_ids for s in shards], dim=1)
    positions = torch.cat([s.position_ids for s in shards], dim=1)
    targets = torch.cat([s.targets for s in shards], dim=1)
    assert {s.input_ids.shape[1] for s in shards} == {total // sp}
    # the real tokens as packed, then the padding as one more sequence from position 0
    assert torch.equal(ids[0, :n], rows.input_ids[0]) and (ids[0, n:] == 0).all()
    assert torch.equal(positions[0, :n], rows.position_ids[0])
    assert positions[0, n:].tolist() == list(range(total - n))
    # each position's next token in the whole row, across the slices' edges
    assert torch.equal(targets[0, :-1], ids[0, 1:])
    for left, right in zip(shards, shards[1:]):
        assert left.targets[0, -1] == right.input_ids[0, 0]
    # every slice carries the whole row's bounds, the padding its own sequence
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()] + ([total] if total > n else [])
    for s in shards:
        assert s.cu_seqlens.dtype == torch.int32 and s.cu_seqlens.tolist() == bounds
        assert s.max_len == max(*lengths, total - n) and s.tokens == n


@pytest.mark.parametrize("sp", [1, 2, 3])
def test_merge_gives_the_unsplit_alignment(sp):
    """Values gathered from the slices (position p about token p + 1) come back as the unsplit head's: position t
    about token t, position 0 zero, the padding dropped; `unpack` then gives the [B, T] layout."""
    lengths = (6, 1, 9, 5, 4)
    rows = _packed(lengths)
    n = sum(lengths)
    shard = split_packed(rows, sp, 0)
    raw = torch.arange(1.0, padded_length(n, sp) + 1)[None]  # what a head would say at each position of the row
    merged = shard.merge(raw)
    unsplit = F.pad(raw[:, :n][:, :-1], (1, 0))  # the unsplit head's shift on the unpadded row
    assert torch.equal(merged, unsplit) and merged.shape == (1, n)
    out = rows.unpack(merged)
    # the first token of each sequence gets 0 (its predecessor is another sequence's), then the raw value before it
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()[:-1]]
    for row, (start, length) in enumerate(zip(starts, lengths)):
        assert out[row, 0] == 0
        assert out[row, 1:length].tolist() == raw[0, start : start + length - 1].tolist()


def _simulated_all_to_all(xs: list[torch.Tensor], scatter_dim: int, gather_dim: int) -> list[torch.Tensor]:
    """What `sequence_parallel.all_to_all` gives each of len(xs) processes: entry i of process j's exchange goes to
    process i, which joins what it receives in process order."""
    n = len(xs)
    sent = [to_exchange(x, n, scatter_dim) for x in xs]
    return [from_exchange(torch.stack([sent[j][i] for j in range(n)]), gather_dim) for i in range(n)]


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_the_all_to_all_turns_sequence_slices_into_head_slices_and_back(sp):
    gen = torch.Generator().manual_seed(0)
    heads, n, d = 8, 12, 3
    full = torch.randn(1, heads, n, d, generator=gen)  # [1, H, N, D] as the attention's query
    slices = list(full.chunk(sp, dim=2))  # each process: its tokens, every head
    by_head = _simulated_all_to_all(slices, scatter_dim=1, gather_dim=2)
    for rank, part in enumerate(by_head):  # each process: every token, its heads
        assert torch.equal(part, full[:, rank * heads // sp : (rank + 1) * heads // sp])
    out = [p.transpose(1, 2) for p in by_head]  # the attention's output layout [1, N, H / sp, D]
    back = _simulated_all_to_all(out, scatter_dim=1, gather_dim=2)
    for rank, part in enumerate(back):
        assert torch.equal(part, full.transpose(1, 2)[:, rank * n // sp : (rank + 1) * n // sp])


def test_kv_heads_are_repeated_only_below_the_group_size():
    assert kv_repeats(28, 4, 2) == 1 and kv_repeats(28, 4, 4) == 1
    assert kv_repeats(4, 1, 2) == 2 and kv_repeats(32, 4, 8) == 2 and kv_repeats(16, 2, 8) == 4
    with pytest.raises(ValueError, match="must divide the model's 28 attention heads"):
        kv_repeats(28, 4, 8)
    with pytest.raises(ValueError, match="must divide the model's 6 key/value heads or be a multiple of them"):
        kv_repeats(12, 6, 4)


def test_model_and_world_checks_name_the_numbers():
    from transformers import LlamaConfig

    check_model(LlamaConfig(num_attention_heads=28, num_key_value_heads=4, hidden_size=28 * 4), 4)
    with pytest.raises(ValueError, match="sequence_parallel 3 must divide the model's 28 attention heads"):
        check_model(LlamaConfig(num_attention_heads=28, num_key_value_heads=4, hidden_size=28 * 4), 3)
    check_world(8, 4)
    with pytest.raises(ValueError, match="sequence_parallel 4 must divide the learner's 6 processes"):
        check_world(6, 4)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nproc": 3}, "must divide learner.nproc 3"),
        ({"nproc": 2, "pack_sequences": False}, "splits packed rows: set learner.pack_sequences"),
        ({"nproc": 2, "share_prefix": True, "logprob_chunk_tokens": 8}, "learner.share_prefix runs padded ones"),
        ({"nproc": 2, "attention": "sdpa"}, "runs varlen attention over the split rows, not 'sdpa'"),
        ({"nproc": 2, "sequence_parallel": 0}, "greater than or equal to 1"),
    ],
)
def test_config_refuses_what_the_split_cannot_run(settings, message):
    with pytest.raises(ValidationError, match=message):
        LearnerConfig.model_validate({"sequence_parallel": 2, **settings})


def test_config_default_is_no_split_and_a_valid_split_parses():
    assert LearnerConfig().sequence_parallel == 1
    assert LearnerConfig.model_validate({"sequence_parallel": 4, "nproc": 8}).sequence_parallel == 4


def test_auto_levers_pack_under_varlen_with_a_split_on_cpu_too():
    config = levers.resolve(make_config({"sequence_parallel": 2, "nproc": 2}), "cpu")
    assert (config.learner.pack_sequences, config.learner.attention) == (True, "varlen")
    unsplit = levers.resolve(make_config(), "cpu")
    assert (unsplit.learner.pack_sequences, unsplit.learner.attention) == (False, "sdpa")


def test_a_split_multiplies_the_token_budget_and_the_longest_row():
    # the 0.5B shape (Qwen2.5) on 139 GiB, two processes
    shape = levers.ModelShape(layers=24, hidden=896, intermediate=4864, vocab=151936, params=494_032_768)
    memory = 139 * 2**30
    one = levers.fitting_tokens(shape, memory, 2, 16384, False, False, False)
    assert levers.fitting_tokens(shape, memory, 2, 16384, False, False, False, sequence_parallel=2) == 2 * one
    assert levers.token_budget(shape, memory, 2, 16384, False, False, False) == levers.MAX_TOKENS  # clamped
    split = levers.token_budget(shape, memory, 2, 16384, False, False, False, sequence_parallel=2)
    assert levers.MAX_TOKENS < split <= 2 * levers.MAX_TOKENS
