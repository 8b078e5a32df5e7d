"""A weight set as a stream of buckets: what every transport sends, whatever carries the bytes.

A bucket is whole tensors, in the set's order, whose bytes add up to at most the bucket size; a tensor
larger than the bucket size travels alone. The set's checksum (`weights.checksum`, sha256 over names,
dtypes, shapes and bytes in order) is computed bucket by bucket, so neither side ever holds the whole set
as one object: the sender holds the bucket it is filling, the receiver the bucket it is checking.

Each bucket carries a check of its bytes, verified by the receiver before the next bucket: a bucket
built here carries `digest` `set-sha256:<hex>`, the set checksum over every tensor up to the bucket's last
(the hash state after feeding it), so each byte is hashed once on each side and the last bucket's
digest is the set checksum. A bucket from elsewhere (`PackedWeights`, a spooled re-push) carries
`sha256` of its own bytes instead (two passes per byte on the receiver); receivers take either."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.weights import SetHasher, TensorSpec, check_source, spec_of, wire_dtype

MiB = 1 << 20


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
    another float dtype than its spec's: it is cast on the way, `weights.fits_spec`). Each bucket's bytes are
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
    layout while the tensors keep their storage (`weight_dist.BucketPacker`)."""

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
