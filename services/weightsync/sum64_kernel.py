"""`sum64` and a bucket's finite check in one pass: a Triton kernel that reads each 8-byte word of the bucket
once, where the torch formulation (`digest._sum64_words` and a float32 sum) reads it three times in ~10
kernel launches. Used on CUDA where Triton is importable; the torch formulation stays the reference (and the
CPU path). The text is the same: the kernel sums the same wrapping products (word x its weight), only in
another order, and sums of int64 products wrap alike in any order.

A grid word i (i < m, the words of whole rows of 1024) weighs 1000003 (i % 1024 + 1) + (i // 1024 + 1) (its
column's weight plus its row's), a word past the last whole row 7 (i - m + 1), the zero-padded tail word
(the bytes past the last whole word) 7 (W - m + 1). The finite check counts the elements whose exponent bits
are all ones (inf, NaN) lane by lane in each word: exact, where a float32 sum also flags finite values that
overflow it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024  # words a program reads per iteration
_ITERS = 32  # iterations a program: 256 KiB of the bucket, 1,024 programs for a 256 MB bucket
_EXPONENT = {torch.float16: (16, 0x7C00), torch.bfloat16: (16, 0x7F80), torch.float32: (32, 0x7F800000)}
FLOAT_DTYPES = frozenset(_EXPONENT)


def sums(buffer: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """[plain, weighted, non-finite elements] (int64, on the buffer's device, not read back) of `buffer`
    (uint8, its start 8-byte aligned). `dtype`: the one floating dtype the bucket holds, or None (no finite
    check: the count is 0)."""
    n = buffer.numel()
    words_n = n // 8
    grid_n = words_n // 1024 * 1024
    lane_bits, exponent = _EXPONENT.get(dtype, (0, 0))
    programs = max(1, -(-words_n // (_BLOCK * _ITERS)))
    device = buffer.device
    partial = torch.empty(programs, 3, dtype=torch.int64, device=device)
    words = buffer[: words_n * 8].view(torch.int64) if words_n else torch.zeros(1, dtype=torch.int64, device=device)
    _sum64_kernel[(programs,)](
        words,
        buffer if n % 8 else words,
        partial,
        words_n,
        grid_n,
        n % 8,
        words_n * 8,
        7 * (words_n - grid_n + 1),
        LANE_BITS=lane_bits,
        EXPONENT=exponent,
        BLOCK=_BLOCK,
        ITERS=_ITERS,
    )
    return partial.sum(dim=0) if programs > 1 else partial[0]


@triton.jit
def _non_finite(w, LANE_BITS: tl.constexpr, EXPONENT: tl.constexpr):
    """Per word, how many of its LANE_BITS-wide lanes have every EXPONENT bit set (an inf or a NaN)."""
    count = tl.zeros(w.shape, dtype=tl.int64)
    for lane in tl.static_range(64 // LANE_BITS):
        bits = (w >> (lane * LANE_BITS)) & EXPONENT
        count += (bits == EXPONENT).to(tl.int64)
    return count


@triton.jit(do_not_specialize=["words_n", "grid_n", "tail_n", "tail_at", "tail_weight"])
def _sum64_kernel(
    words,
    tail_bytes,
    partial,
    words_n,
    grid_n,
    tail_n,
    tail_at,
    tail_weight,
    LANE_BITS: tl.constexpr,
    EXPONENT: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    plain = tl.zeros([BLOCK], dtype=tl.uint64)
    weighted = tl.zeros([BLOCK], dtype=tl.uint64)
    bad = tl.zeros([BLOCK], dtype=tl.int64)
    for it in range(ITERS):
        i = base + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        w = tl.load(words + i, mask=i < words_n, other=0).to(tl.uint64, bitcast=True)
        weight = tl.where(i < grid_n, 1000003 * (i % 1024 + 1) + (i // 1024 + 1), 7 * (i - grid_n + 1))
        plain += w
        weighted += w * weight.to(tl.uint64, bitcast=True)
        if LANE_BITS:
            bad += _non_finite(w, LANE_BITS, EXPONENT)
    total_plain = tl.sum(plain, axis=0)
    total_weighted = tl.sum(weighted, axis=0)
    total_bad = tl.sum(bad, axis=0)
    if (pid == 0) & (tail_n > 0):  # the zero-padded tail word, once
        j = tl.arange(0, 8)
        b = tl.load(tail_bytes + tail_at + j, mask=j < tail_n, other=0).to(tl.uint64)
        tail = tl.sum(b << (8 * j).to(tl.uint64), axis=0)
        total_plain += tail
        total_weighted += tail * tail_weight.to(tl.int64).to(tl.uint64, bitcast=True)
        if LANE_BITS:
            total_bad += tl.sum(_non_finite(tail + tl.zeros([1], dtype=tl.uint64), LANE_BITS, EXPONENT), axis=0)
    tl.store(partial + pid * 3, total_plain.to(tl.int64, bitcast=True))
    tl.store(partial + pid * 3 + 1, total_weighted.to(tl.int64, bitcast=True))
    tl.store(partial + pid * 3 + 2, total_bad)
