"""A weight set as a stream of buckets: what every transport sends, whatever carries the bytes.

A bucket is whole tensors, in the set's order, whose bytes add up to at most the bucket size; a tensor
larger than the bucket size travels alone. The set's checksum (`wire.checksum`, sha256 over names,
dtypes, shapes and bytes in order) is computed bucket by bucket, so neither side ever holds the whole set
as one object: the sender holds the bucket it is filling, the receiver the bucket it is checking.

Each bucket carries a check of its bytes, verified by the receiver before the next bucket: a bucket
built here carries `digest` `set-sha256:<hex>`, the set checksum over every tensor up to the bucket's last
(the hash state after feeding it), so each byte is hashed once on each side and the last bucket's
digest is the set checksum. A bucket from elsewhere (`PackedWeights`, a spooled re-push) carries
`sha256` of its own bytes instead (two passes per byte on the receiver); receivers take either.

Here too: the sets a pusher reads (`TensorWeights` from tensors, `PackedWeights` from one byte string), and
the rules every receiver holds a bucket's declaration to (`check_header_sizes`, `check_declaration`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.weightsync.wire import (
    CHUNK_BYTES,
    SetHasher,
    TensorSpec,
    WeightSetRejected,
    check_source,
    raw_bytes,
    spec_of,
    wire_dtype,
)

MiB = 1 << 20
MAX_BUCKET_BYTES = 4 << 30
"""Largest bucket a header may declare: the bound on what one push holds in this process's memory."""


@dataclass(frozen=True)
class Bucket:
    specs: tuple[TensorSpec, ...]
    data: memoryview
    sha256: str
    """sha256 of `data`, hex; "" when `digest` is set."""
    digest: str = ""
    """`set-sha256:<hex>`: the set checksum up to this bucket's last tensor (see the module docstring)."""

    @property
    def check(self) -> str:
        """What the receiver verifies the bucket against: the digest, else the sha256."""
        return self.digest or self.sha256

    @property
    def nbytes(self) -> int:
        return len(self.data)


def sha256_of(data) -> str:
    return hashlib.sha256(data).hexdigest()


class WeightSet(Protocol):
    """What a pusher sends: the tensor specs (known before any data), and buckets in their order.
    `checksum` is "" until a full pass over the buckets has computed it."""

    specs: list[TensorSpec]
    checksum: str

    def buckets(self, bucket_bytes: int) -> Iterator[Bucket]: ...


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[tuple[TensorSpec, ...]]:
    """Splits `specs` (in order) into buckets of at most `bucket_bytes`, a larger tensor on its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    plan: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + spec.nbytes > bucket_bytes:
            plan.append(tuple(current))
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        plan.append(tuple(current))
    return plan


def _copy_into(buffer: bytearray, offset: int, t: torch.Tensor, dtype: torch.dtype) -> None:
    """`t`'s bytes as `dtype` (cast first where the source holds another float dtype: on its own device,
    so fewer bytes cross to the host) into `buffer` at `offset`."""
    if t.numel():
        flat = t.detach().to(dtype).contiguous().cpu().reshape(-1).view(torch.uint8)
        torch.frombuffer(buffer, dtype=torch.uint8, offset=offset, count=flat.numel()).copy_(flat)


def bucket_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    specs: Sequence[TensorSpec],
    bucket_bytes: int,
    hasher: SetHasher | None = None,
) -> Iterator[Bucket]:
    """Buckets of `named_tensors`, which must yield exactly `specs` in order (a float tensor may be held in
    another float dtype than its spec's: it is cast on the way, `wire.fits_spec`). Each bucket's bytes are
    copied once, straight from the tensors into the bucket's own buffer. With `hasher` (the set
    checksum) each bucket is fed to it and carries its `set-sha256:` digest (one hash pass); without,
    it carries the sha256 of its bytes."""
    it = iter(named_tensors)
    for planned in plan_buckets(specs, bucket_bytes):
        buffer = bytearray(sum(s.nbytes for s in planned))
        offset = 0
        for spec in planned:
            name, t = next(it, (None, None))
            check_source(name, t, spec)
            _copy_into(buffer, offset, t, wire_dtype(spec.dtype))
            offset += spec.nbytes
        view = memoryview(buffer)
        if hasher is None:
            yield Bucket(planned, view, sha256_of(view))
        else:
            hash_specs(hasher, planned, view)
            yield Bucket(planned, view, "", hasher.running())
    if next(it, None) is not None:
        raise ValueError("weight source yielded more tensors than its specs declare")


class TensorWeights:
    """A weight set read from tensors on demand: `source()` is called for each pass and yields
    (name, tensor) in `specs` order (an FSDP source gathers each tensor as it is asked for), each in its
    spec's dtype or, for a float tensor, in the dtype it is stored in (cast where it is packed). The
    checksum is filled in by the first complete pass.

    `stable`: the set's tensors, in `specs` order, where every pass yields exactly these (no gather, no
    copy: plain tensors, a one-process FSDP mesh), so a sender may lay out its buckets once and reuse the
    layout while the tensors keep their storage (`nccl.pack.BucketPacker`)."""

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        source: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        stable: Sequence[torch.Tensor] | None = None,
    ):
        self.specs, self.checksum, self._source = list(specs), "", source
        self._stable = list(stable) if stable is not None else None

    @classmethod
    def of(cls, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> TensorWeights:
        named = list(named_tensors)
        return cls([spec_of(n, t) for n, t in named], lambda: named, [t for _, t in named])

    def named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self._source()

    def stable_tensors(self) -> list[torch.Tensor] | None:
        """The tensors every pass yields (see the class docstring), or None where a pass gathers or copies."""
        return self._stable

    def buckets(self, bucket_bytes: int) -> Iterator[Bucket]:
        hasher = SetHasher()
        yield from bucket_tensors(self._source(), self.specs, bucket_bytes, hasher)
        self.checksum = hasher.hexdigest()


def hash_specs(hasher: SetHasher, specs: Sequence[TensorSpec], data) -> None:
    """Feeds one bucket's tensors (their bytes laid end to end in `data`) to the set checksum."""
    offset = 0
    for spec in specs:
        hasher.add(spec, data[offset : offset + spec.nbytes])
        offset += spec.nbytes


@dataclass
class PackedWeights:
    """A set held as one byte string (`pack`): hand-made sets, and tests that edit the bytes on the way."""

    specs: list[TensorSpec]
    checksum: str
    payload: bytes

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[bytes]:
        view = memoryview(self.payload)
        for start in range(0, len(view), size):
            yield bytes(view[start : start + size])

    def buckets(self, bucket_bytes: int) -> Iterator[Bucket]:
        """The payload cut at tensor boundaries (tests send hand-made sets through the bucketed wire)."""
        view, offset = memoryview(self.payload), 0
        for planned in plan_buckets(self.specs, bucket_bytes):
            size = sum(s.nbytes for s in planned)
            data = view[offset : offset + size]
            offset += size
            yield Bucket(planned, data, sha256_of(data))


def pack(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> PackedWeights:
    hasher, specs, parts = SetHasher(), [], []
    for name, t in named_tensors:
        spec, data = spec_of(name, t), raw_bytes(t)
        hasher.add(spec, data)
        specs.append(spec)
        parts.append(data)
    return PackedWeights(specs, hasher.hexdigest(), b"".join(parts))


class ChecksumMismatch(ValueError):
    pass


def unpack(specs: Sequence[TensorSpec], payload: bytes, expected_checksum: str) -> list[tuple[str, torch.Tensor]]:
    """Rebuilds tensors from the bytes; raises before returning anything if sizes or checksum differ."""
    total = sum(s.nbytes for s in specs)
    if total != len(payload):
        raise ChecksumMismatch(f"expected {total} bytes of tensors, received {len(payload)}")
    hasher, out, offset = SetHasher(), [], 0
    buffer = bytearray(payload)
    for spec in specs:
        data = memoryview(buffer)[offset : offset + spec.nbytes]
        hasher.add(spec, data)
        flat = torch.frombuffer(data, dtype=torch.uint8) if spec.nbytes else torch.empty(0, dtype=torch.uint8)
        out.append((spec.name, flat.view(getattr(torch, spec.dtype)).reshape(spec.shape)))
        offset += spec.nbytes
    if hasher.hexdigest() != expected_checksum:
        raise ChecksumMismatch(f"checksum {hasher.hexdigest()[:12]} != expected {expected_checksum[:12]}")
    return out


def check_header_sizes(specs: Sequence[TensorSpec], bucket_bytes: int, total_bytes: int) -> None:
    declared = sum(s.nbytes for s in specs)
    if not 0 < bucket_bytes <= MAX_BUCKET_BYTES:
        raise WeightSetRejected(f"bucket size {bucket_bytes} is not in 1..{MAX_BUCKET_BYTES} bytes")
    if total_bytes != declared:
        raise WeightSetRejected(f"header declares {total_bytes} bytes, its tensors take {declared}")


def check_declaration(
    header_specs: Sequence[TensorSpec], next_index: int, specs: Sequence[TensorSpec], nbytes: int, bucket_bytes: int
) -> tuple[TensorSpec, ...]:
    """A bucket declares exactly the header's next tensors (from `next_index`), their byte count, and at most
    `bucket_bytes` unless it is one tensor; returns those header specs."""
    if not specs:
        raise WeightSetRejected("a bucket declares no tensors")
    expected = tuple(header_specs[next_index : next_index + len(specs)])
    for i, spec in enumerate(specs):
        if i >= len(expected):
            raise WeightSetRejected(f"bucket declares {spec.name!r} past the end of the header's tensors")
        if tuple(spec.shape) != tuple(expected[i].shape) or spec != expected[i]:
            raise WeightSetRejected(f"bucket declares {spec}, the header's next tensor is {expected[i]}")
    if nbytes != sum(s.nbytes for s in specs):
        raise WeightSetRejected(f"bucket declares {nbytes} bytes, its tensors take {sum(s.nbytes for s in specs)}")
    if nbytes > bucket_bytes and len(specs) > 1:
        raise WeightSetRejected(f"bucket of {nbytes} bytes exceeds the header's bucket size {bucket_bytes}")
    return expected
