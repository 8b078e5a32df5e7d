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

from services.common.weights import TensorSpec

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

    from services.common.weights import tensor_views

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
        from services.common.weight_buckets import Bucket, hash_specs
        from services.common.weights import SetHasher

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


def write_at(path: str, offset: int, data) -> None:
    """`data` (a buffer) into the existing file at `path` from `offset`."""
    fd = os.open(path, os.O_WRONLY)
    try:
        view, at = memoryview(data).cast("B"), 0
        while at < len(view):
            at += os.pwrite(fd, view[at:], offset + at)
    finally:
        os.close(fd)


class BucketStager:
    """Writes received buckets into a spool file at the offsets the server chose (the `nccl` push's staging in
    the vLLM worker). A CPU bucket is written before `stage` returns: its buffer is the receiver's, reused by
    the receive after next. A CUDA bucket is copied into one of two reused pinned host buffers on the current
    stream (a later receive into the same device buffer is ordered after that stream, so it cannot overwrite
    the bucket first) and written from there by a background thread once the copy ends: the caller goes back
    to the wire while the bucket goes to the file, where a synchronous copy into fresh pageable memory (1.4
    GB/s on an H200 host, against 55 GB/s into pinned memory) and the write held the worker for both. One
    writer: writes into one file went no faster with 4-16 threads (on that host ~4 GB/s into a disk-backed
    temp folder, ~2.7 GB/s into tmpfs).
    `drain()` waits for every write and raises the first failure (before a commit is verified); `close()`
    waits without raising and ends the thread."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spool-stage")
        self._pinned: list = [None, None]
        self._jobs: list = [None, None]
        self._staged = 0

    def stage(self, path: str, offset: int, data) -> None:
        """`data` (uint8, CPU or CUDA) into `path` at `offset`."""
        if not data.is_cuda:
            write_at(path, offset, data.numpy())
            return
        import torch

        slot = self._staged % 2
        self._staged += 1
        self._wait(slot)  # that pinned buffer's previous bucket is written (its error raised here)
        host = self._pinned[slot]
        if host is None or host.numel() < data.numel():
            self._pinned[slot] = None
            host = self._pinned[slot] = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
        host = host[: data.numel()]
        host.copy_(data, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self._jobs[slot] = self._pool.submit(_write_when_copied, copied, path, offset, host)

    def drain(self) -> None:
        """Every staged bucket is in the file; the first failed write raises (after both have ended)."""
        errors = [self._wait(slot, raise_=False) for slot in (0, 1)]
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        for slot in (0, 1):
            self._wait(slot, raise_=False)
        self._pool.shutdown(wait=True)
        self._pinned = [None, None]

    def _wait(self, slot: int, raise_: bool = True) -> BaseException | None:
        job, self._jobs[slot] = self._jobs[slot], None
        error = job.exception() if job is not None else None
        if error is not None and raise_:
            raise error
        return error


def _write_when_copied(copied, path: str, offset: int, host) -> None:
    copied.synchronize()
    write_at(path, offset, host.numpy())


class HostArena:
    """The staged buckets of a push in host memory instead of a spool file (`rollout.weight_staging: memory`):
    one buffer of the set's size, kept from push to push (pinned where the buckets come from a GPU, so each
    is one DMA copy out and, at the commit, one back), buckets laid end to end in arrival order and found
    again by the spool path and offset the server gave them. A CUDA bucket's copy is queued on the current
    stream (the next receive into its device buffer is ordered after it); `drain()` waits for the copies.
    Costs the set's size in host memory for the life of the process; nothing is written to disk."""

    ALIGN = 256  # each bucket starts on this boundary in the arena (typed views need aligned storage)

    @classmethod
    def span(cls, total_bytes: int, tensors: int) -> int:
        """The arena a push of `total_bytes` in at most `tensors` buckets needs, alignment included."""
        return total_bytes + cls.ALIGN * max(1, tensors)

    def __init__(self):
        self._buffer = None
        self._where: dict[tuple[str, int], tuple[int, int]] = {}
        self._end = 0
        self._copied = None

    def begin(self, total_bytes: int, *, pinned: bool) -> None:
        """A push of `total_bytes` starts: what an earlier push staged is forgotten."""
        import torch

        self._where.clear()
        self._end = 0
        self._copied = None
        buffer = self._buffer
        if buffer is None or buffer.numel() < total_bytes or buffer.is_pinned() != pinned:
            self._buffer = None  # the earlier one goes before the new one is allocated
            self._buffer = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=pinned)

    def stage(self, path: str, offset: int, data) -> None:
        n = data.numel()
        capacity = 0 if self._buffer is None else self._buffer.numel()
        if self._end + n > capacity:
            raise ValueError(f"staged buckets overflow the arena of {capacity} bytes opened for this push")
        self._buffer[self._end : self._end + n].copy_(data, non_blocking=data.is_cuda)
        if data.is_cuda:
            import torch

            self._copied = torch.cuda.Event()
            self._copied.record()
        self._where[path, offset] = (self._end, n)
        self._end += n + -(self._end + n) % self.ALIGN

    def drain(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def close(self) -> None:
        self.drain()

    def tensors(self, path: str, offset: int, specs) -> list | None:
        """The bucket staged at (`path`, `offset`) as views of the arena, or None if this push did not stage it
        here."""
        from services.common.weights import tensor_views

        where = self._where.get((path, offset))
        if where is None:
            return None
        start, n = where
        if n != sum(s.nbytes for s in specs):
            raise ValueError(f"bucket at {offset} staged {n} bytes, its specs take {sum(s.nbytes for s in specs)}")
        return tensor_views(specs, self._buffer[start : start + n])
