"""The receiving end of a bucketed weight push: every bucket is checked as it arrives and parked in a
spool file, so memory holds one bucket and nothing reaches the engine before the whole set verified.

Order of a push: header (checked against the served model by `RolloutCore.admit` before this exists),
then per bucket its declaration (specs, size, sha256) and data, then a commit carrying the set checksum.
A bucket must declare exactly the next tensors of the header, in order, and at most the header's bucket
size (a larger tensor travels alone); data past the declared size is refused at the chunk that
overflows. Any refusal, or a stream that ends without its commit, deletes the spool."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from services.common.weight_buckets import hash_specs, sha256_while
from services.common.weight_spool import SpoolWriter, WeightSpool
from services.common.weights import SetHasher, TensorSpec, WeightSetRejected, check_finite, tensor_views

MAX_BUCKET_BYTES = 4 << 30
"""Largest bucket a header may declare: the bound on what one push holds in this process's memory."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


class BucketReceiver:
    def __init__(self, specs: Sequence[TensorSpec], bucket_bytes: int, total_bytes: int, spool_dir: str | None = None):
        check_header_sizes(specs, bucket_bytes, total_bytes)
        self.specs, self.bucket_bytes = list(specs), bucket_bytes
        self.received = 0
        self._next = 0  # index of the first tensor not yet declared by a bucket
        self._hasher = SetHasher()
        self._buffer: memoryview | None = None
        self._bucket: tuple[tuple[TensorSpec, ...], str] | None = None
        self._reusable = bytearray()
        self._filled = 0
        self._spool = SpoolWriter(spool_dir)

    def start_bucket(self, specs: Sequence[TensorSpec], nbytes: int, sha256: str) -> None:
        self._close_bucket()
        expected = check_declaration(self.specs, self._next, specs, nbytes, self.bucket_bytes)
        if not _SHA256.fullmatch(sha256):
            raise WeightSetRejected("bucket sha256 is not 64 lowercase hex digits")
        self._next += len(specs)
        if len(self._reusable) < nbytes:  # one buffer for every bucket: no page faults per bucket
            self._reusable = bytearray(nbytes)
        self._bucket, self._buffer, self._filled = (tuple(expected), sha256), memoryview(self._reusable)[:nbytes], 0

    def add_data(self, data: bytes) -> None:
        if self._buffer is None:
            raise WeightSetRejected("data before any bucket declaration")
        end = self._filled + len(data)
        if end > len(self._buffer):
            raise WeightSetRejected(f"more data than the {len(self._buffer)} bytes its bucket declared")
        self._buffer[self._filled : end] = data
        self._filled = end

    def _close_bucket(self) -> None:
        if self._bucket is None:
            return
        (specs, sha256), buffer = self._bucket, self._buffer
        if self._filled != len(buffer):
            raise WeightSetRejected(f"bucket of {specs[0].name!r}: {self._filled} of {len(buffer)} bytes received")
        # The set checksum is fed before the digest is compared: a mismatch ends the push anyway.
        digest = sha256_while(buffer, lambda: hash_specs(self._hasher, specs, buffer))
        if digest != sha256:
            raise WeightSetRejected(f"bucket of {specs[0].name!r}: sha256 does not match its bytes")
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
        check_finite(tensor_views(specs, flat))
        self._spool.add(specs, buffer)
        self.received += len(buffer)
        self._bucket, self._buffer = None, None

    def commit(self, checksum: str) -> WeightSpool:
        """Closes the last bucket and checks the set is whole and matches `checksum`; the caller owns
        (and deletes) the returned spool."""
        self._close_bucket()
        if self._next != len(self.specs):
            raise WeightSetRejected(f"push ended after {self._next} of {len(self.specs)} tensors")
        if self._hasher.hexdigest() != checksum:
            raise WeightSetRejected(f"checksum {self._hasher.hexdigest()[:12]} != declared {checksum[:12]}")
        return self._spool.finish()

    def abort(self) -> None:
        self._buffer, self._reusable = None, bytearray()
        self._spool.discard()
