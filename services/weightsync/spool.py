"""Received buckets parked in one temporary file until the whole set has checked out.

The rollout server writes each bucket's bytes here as they arrive (its checks run alongside, and the
bucket is verified before the next one is accepted), so its memory holds one bucket. Nothing is read
back before the commit verified every bucket and the set: then the engine reads the buckets one at a
time through a private memory map (pages come from the page cache, nothing is copied into the process
until the engine copies into its parameters).
Buckets start on page boundaries so each can be mapped on its own. The file is deleted when the push
is applied, refused or interrupted."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from services.weightsync.buckets import Bucket, hash_specs
from services.weightsync.wire import SetHasher, TensorSpec, tensor_views

PAGE = mmap.ALLOCATIONGRANULARITY


@dataclass(frozen=True)
class SpooledBucket:
    offset: int
    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def to_info(self, path: str) -> dict:
        """Plain values (msgpack-safe) for a vLLM weight-transfer `update_info`."""
        return {
            "path": path,
            "offset": self.offset,
            "names": [s.name for s in self.specs],
            "dtype_names": [s.dtype for s in self.specs],
            "shapes": [list(s.shape) for s in self.specs],
            "sizes": [s.nbytes for s in self.specs],
        }


@dataclass
class WeightSpool:
    path: str
    buckets: list[SpooledBucket]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def delete(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def named_tensors(self, copy: bool = True):
        """(name, tensor) of every bucket in order, one bucket mapped at a time. `copy=False` yields views
        of the map that are only valid until the next bucket is read."""
        for bucket in self.buckets:
            with mapped_bucket(self.path, bucket.offset, bucket.specs) as tensors:
                for name, t in tensors:
                    yield name, (t.clone() if copy else t)


@contextlib.contextmanager
def mapped_bucket(path: str, offset: int, specs) -> Iterator[list]:
    """The tensors of one bucket as views of a private (copy-on-write) map of the spool file."""
    import torch

    size = sum(s.nbytes for s in specs)
    with open(path, "rb") as f:
        if size == 0:
            yield [(s.name, torch.empty(tuple(s.shape), dtype=getattr(torch, s.dtype))) for s in specs]
            return
        region = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY, offset=offset)
    # Not closed here: a loader may keep views past this bucket (vLLM's layerwise reload holds a layer's
    # tensors until the layer is complete), and closing unmaps under them. The map goes with its last view.
    flat = torch.frombuffer(region, dtype=torch.uint8)
    del region
    yield tensor_views(specs, flat)


class SpoolWriter:
    """Appends buckets to a fresh file under `directory`; `finish()` hands over the spool, `discard()`
    (or an exception inside `with`) deletes it."""

    def __init__(self, directory: str | None = None):
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="omrl-weights-", suffix=".spool", dir=directory or None)
        self._file = os.fdopen(fd, "wb")
        self._buckets: list[SpooledBucket] = []
        self._offset = 0

    def add(self, specs, data) -> None:
        self.start(specs)
        self.write(data)

    def start(self, specs) -> None:
        """A bucket begins (on a page boundary); its bytes follow through `write`, in pieces."""
        pad = -self._offset % PAGE
        if pad:
            self._file.write(b"\0" * pad)
            self._offset += pad
        self._buckets.append(SpooledBucket(self._offset, tuple(specs)))

    def write(self, data) -> None:
        self._file.write(data)
        self._offset += len(data)

    def finish(self) -> WeightSpool:
        self._file.close()
        return WeightSpool(self.path, list(self._buckets))

    def discard(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> SpoolWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            self.discard()


class SpooledWeights:
    """A weight set read back from a spool: what a learner whose model is sharded over several ranks
    re-sends to a server that fell behind (re-reading the model would be a collective)."""

    def __init__(self, specs, checksum: str, spool: WeightSpool):
        self.specs, self.checksum, self.spool = list(specs), checksum, spool

    def buckets(self, bucket_bytes: int):
        """The spooled buckets as they were sent (their size was set by the first push), with their
        `set-sha256:` digests."""
        hasher = SetHasher()
        for bucket in self.spool.buckets:
            with open(self.spool.path, "rb") as f:
                f.seek(bucket.offset)
                data = memoryview(f.read(bucket.nbytes))
            hash_specs(hasher, bucket.specs, data)
            yield Bucket(bucket.specs, data, "", hasher.running())


class TeeToSpool:
    """Passes a weight set's buckets through while writing them to a spool; `spooled()` after the pass."""

    def __init__(self, weights, directory: str | None = None):
        self.weights, self.directory, self.spool = weights, directory, None
        self.specs = weights.specs

    @property
    def checksum(self) -> str:
        return self.weights.checksum

    def buckets(self, bucket_bytes: int):
        with SpoolWriter(self.directory) as writer:
            for bucket in self.weights.buckets(bucket_bytes):
                writer.add(bucket.specs, bucket.data)
                yield bucket
        self.spool = writer.finish()

    def spooled(self) -> SpooledWeights | None:
        return SpooledWeights(self.specs, self.checksum, self.spool) if self.spool is not None else None
