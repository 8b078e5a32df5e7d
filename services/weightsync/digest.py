"""A bucket's digest and the checksum of a set sent as digested buckets.

Bucket digest: `sha256:<hex>` of the bytes where the bucket is a CPU tensor (the gRPC path's digest), and
on CUDA `sum64:<hex>`: a wrapping int64 sum and a position-weighted sum of the bucket's 8-byte words,
computed on the device (one pass of a Triton kernel, `sum64_kernel`, no host copy). It catches
truncation, dropped or reordered words and random corruption; it is not a cryptographic hash (the bytes
come from an authenticated peer over a private network; the digest guards against transport faults, not
forgery). A received bucket's digest and its finite check are read back together (`checked_digest`).

The set checksum of an `nccl` push (`set_checksum`) is computed over the tensors' specs and the bucket
digests, from the control plane alone, by both sides. (A `grpc` push chains its buckets into the set
checksum itself: `wire.SetHasher`.)"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence

import torch

from services.weightsync.wire import TensorSpec


def bucket_digest(buffer: torch.Tensor) -> str:
    """`sha256:` on CPU, `sum64:` on a GPU (see the module docstring)."""
    if buffer.device.type == "cpu":
        return "sha256:" + hashlib.sha256(buffer.numpy() if buffer.numel() else b"").hexdigest()
    return sum64(buffer)


def sum64(buffer: torch.Tensor) -> str:
    """`sum64:` + byte count, a wrapping int64 sum of the 8-byte words, and an order-sensitive wrapping
    sum: the words laid out as rows of 1024, their row sums and column sums each weighted by position
    (a word moved to another row or column changes it). On CUDA one pass over the buffer (`sum64_kernel`),
    no copy of it, one host sync."""
    sums = _kernel_sums(buffer, None)
    plain, weighted = (sums[:2] if sums is not None else _sum64_words(buffer)).tolist()
    return _sum64_text(buffer.numel(), plain, weighted)


_kernel_broken: list[str] = []  # why the one-pass kernel failed in this process, once it has


def _kernel_sums(buffer: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`sum64_kernel.sums` for a CUDA buffer where Triton imports and builds the kernel, else None: the torch
    formulation then (the reference, and the CPU path; `OMRL_SUM64_KERNEL=0` forces it). A kernel that fails
    to build (no compiler, no writable cache) is not tried again in this process."""
    if buffer.device.type != "cuda" or _kernel_broken or os.environ.get("OMRL_SUM64_KERNEL", "1") == "0":
        return None
    try:
        from services.weightsync import sum64_kernel

        if dtype is not None and dtype not in sum64_kernel.FLOAT_DTYPES:
            return None
        return sum64_kernel.sums(buffer, dtype)
    except Exception as exc:  # noqa: BLE001 - Triton missing or unable to build here: the torch formulation
        _kernel_broken.append(repr(exc))
        logging.getLogger(__name__).warning("sum64: the Triton kernel is unavailable (%r); digesting with torch", exc)
        return None


def _sum64_text(n: int, plain: int, weighted: int) -> str:
    return f"sum64:{n:016x}{plain & (2**64 - 1):016x}{weighted & (2**64 - 1):016x}"


def _sum64_words(buffer: torch.Tensor) -> torch.Tensor:
    """The two sums of `sum64` as an int64 tensor of 2 on the buffer's device (not read back). The column
    sums, the words past the last whole row (then the tail's bytes as one zero-padded word, then zeros up to
    a fixed length) and the row sums go into one vector, weighted by a prefix of one cached [2, L] matrix
    (1/0 for the plain sum; the position ramps for the weighted one): a handful of kernel launches a bucket
    whatever its size, where a ramp, a product and a sum per part took ~20 (host-bound on a GPU: 2 x H200
    traces showed them spaced by the launches)."""
    n, cols = buffer.numel(), _SUM64_COLS
    whole = n - n % 8
    words = buffer[:whole].view(torch.int64)
    m = words.numel() // cols * cols
    grid = words[:m].view(-1, cols)
    rest = [words[m:]]
    if n % 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=buffer.device)
        tail[: n % 8] = buffer[whole:]
        rest.append(tail.view(torch.int64))
    weights, zeros = _sum64_weights(grid.shape[0], buffer.device)
    padding = zeros[: _SUM64_REST - sum(t.numel() for t in rest)]
    values = torch.cat([grid.sum(dim=0), *rest, padding, grid.sum(dim=1)])
    return (weights[:, : values.numel()] * values).sum(dim=1)


_SUM64_COLS = 1024
_SUM64_REST = _SUM64_COLS  # words past the last whole row (at most 1023), then the tail's word
_sum64_held: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _sum64_weights(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([2, 1024 + 1024 + R] int64 weights for R >= `rows` row sums, [1024] zeros), one pair per device,
    regrown (doubling) when a larger bucket comes. Plain sum: columns 0, rest and rows 1. Weighted sum:
    column c 1000003 (c+1), rest word k 7 (k+1), row r r+1; the rest's zero padding adds nothing."""
    held = _sum64_held.get(device)
    if held is not None and held[0].shape[1] >= _SUM64_COLS + _SUM64_REST + rows:
        return held
    if held is not None:
        rows = max(rows, 2 * (held[0].shape[1] - _SUM64_COLS - _SUM64_REST))

    def ramp(k: int, factor: int = 1) -> torch.Tensor:
        return torch.arange(1, k + 1, dtype=torch.int64) * factor

    ones, nothing = torch.ones(_SUM64_REST + rows, dtype=torch.int64), torch.zeros(_SUM64_COLS, dtype=torch.int64)
    plain = torch.cat([nothing, ones])
    weighted = torch.cat([ramp(_SUM64_COLS, 1000003), ramp(_SUM64_REST, 7), ramp(rows)])
    held = _sum64_held[device] = (
        torch.stack([plain, weighted]).to(device),
        torch.zeros(_SUM64_REST, dtype=torch.int64, device=device),
    )
    return held


def checked_digest(specs: Sequence[TensorSpec], buffer: torch.Tensor) -> tuple[str, bool]:
    """A received bucket's digest and whether its values are cleared as finite by one whole-bucket sum
    (False: it needs `check_finite` tensor by tensor, to name a culprit or to clear an overflowing sum of
    finite values, or because the bucket mixes dtypes). On a GPU the digest's two sums and the finite
    sum are read back together: one host sync per bucket."""
    return checked_digest_as(buffer, whole_dtype(specs, buffer))


def checked_digest_as(buffer: torch.Tensor, dtype: torch.dtype | None) -> tuple[str, bool]:
    """`checked_digest` with the bucket's one floating dtype (`whole_dtype`) already known."""
    if buffer.device.type == "cpu":
        finite = dtype is not None and bool(torch.isfinite(buffer.view(dtype).sum(dtype=torch.float32)))
        return bucket_digest(buffer), finite
    return _sum64_checked(buffer, dtype)


def _sum64_checked(buffer: torch.Tensor, dtype: torch.dtype | None) -> tuple[str, bool]:
    """`sum64` and, for a bucket of one floating `dtype`, whether its values are cleared as finite: one read
    back. Through the one-pass kernel: no element's exponent bits all ones. Else: the float32 sum is finite
    (its bits read beside the digest's words; finite unless its exponent bits are all ones)."""
    sums = _kernel_sums(buffer, dtype)
    if sums is not None:
        plain, weighted, bad = sums.tolist()
        return _sum64_text(buffer.numel(), plain, weighted), dtype is not None and bad == 0
    words = _sum64_words(buffer)
    if dtype is None:
        read = words.tolist()
        return _sum64_text(buffer.numel(), read[0], read[1]), False
    total = buffer.view(dtype).sum(dtype=torch.float32).view(1).view(torch.int32).to(torch.int64)
    plain, weighted, bits = torch.cat([words, total]).tolist()
    return _sum64_text(buffer.numel(), plain, weighted), (bits >> 23) & 0xFF != 0xFF


def whole_dtype(specs: Sequence[TensorSpec], buffer: torch.Tensor) -> torch.dtype | None:
    """The bucket's dtype where one floating dtype fills it (its finite check is one sum), else None."""
    dtypes = {s.dtype for s in specs}
    dtype = getattr(torch, next(iter(dtypes))) if len(dtypes) == 1 and buffer.numel() else None
    return dtype if dtype is not None and dtype.is_floating_point else None


def digest_algorithm(device: str | torch.device) -> str:
    return "sha256" if torch.device(device).type == "cpu" else "sum64"


def set_checksum(specs: Sequence[TensorSpec], digests: Sequence[str]) -> str:
    """The checksum a `nccl` push reports: sha256 over every tensor's name, dtype and shape and every
    bucket's digest, in order. Both sides compute it from the control plane alone (the data was checked
    bucket by bucket against those digests)."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}\0{s.dtype}\0{','.join(map(str, s.shape))}\0".encode())
    for d in digests:
        h.update(d.encode() + b"\n")
    return h.hexdigest()
