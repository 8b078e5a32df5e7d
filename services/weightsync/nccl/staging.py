"""Where an `nccl` push's buckets wait until its commit verified. The rollout server's record of the push
(`NcclStaging`; the data comes by broadcast to the engine's workers, `receive`): the same declaration rules
as a `grpc` push (`buckets.check_declaration`), a spool file whose bucket offsets this side chooses, and the
set checksum over the declared digests (`digest.set_checksum`). In the worker, the bucket just checked is
written into that spool file at its offset (`BucketStager`), or with `rollout.weight_staging: memory` into a
host buffer (`HostArena`).

The workers write each bucket into the spool only after its digest and finite values checked; the set
is applied from the spool at a commit that verifies, as for a gRPC push. Any refusal, or a stream that
ends without its commit, deletes the spool."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from services.weightsync.buckets import check_declaration, check_header_sizes
from services.weightsync.digest import set_checksum
from services.weightsync.spool import PAGE, SpooledBucket, WeightSpool
from services.weightsync.wire import TensorSpec, WeightSetRejected

_DIGEST = re.compile(r"(sha256:[0-9a-f]{64}|sum64:[0-9a-f]{48})")


class NcclStaging:
    """The server's record of an `nccl` push: declarations checked against the header, the spool's bucket
    offsets, the digests. With `digests_follow` a bucket is declared without its digest, which comes in a
    `bucket_digest` message before the next declaration or the commit; the worker checks a bucket only when
    the next one is declared (or at the flush), so each declaration hands it the previous bucket's digest."""

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        total_bytes: int,
        spool_dir: str | None = None,
        *,
        digests_follow: bool = False,
    ):
        check_header_sizes(specs, bucket_bytes, total_bytes)
        self.specs, self.bucket_bytes, self.digests_follow = list(specs), bucket_bytes, digests_follow
        if spool_dir:
            Path(spool_dir).mkdir(parents=True, exist_ok=True)
        fd, self.path = tempfile.mkstemp(prefix="omrl-weights-", suffix=".spool", dir=spool_dir or None)
        os.close(fd)
        self.buckets: list[SpooledBucket] = []
        self.digests: list[str] = []
        self._next = 0
        self._end = 0

    def declare(self, specs: Sequence[TensorSpec], nbytes: int, digest: str) -> dict:
        """Checks a bucket's declaration; returns the engine's `update_info` that receives it (with
        `previous_digest`, the digest of the bucket before it, where digests follow)."""
        expected = check_declaration(self.specs, self._next, specs, nbytes, self.bucket_bytes)
        if self.digests_follow:
            if digest:
                raise WeightSetRejected("digests follow their buckets in this push: a declaration carries none")
            self._require_digests()
        elif not _DIGEST.fullmatch(digest):
            raise WeightSetRejected("bucket digest is not sha256:<64 hex> or sum64:<48 hex>")
        offset = self._end + (-self._end % PAGE)
        bucket = SpooledBucket(offset, expected)
        self._next += len(expected)
        self._end = offset + nbytes
        previous = self.digests[-1] if self.digests_follow and self.digests else ""
        self.buckets.append(bucket)
        if not self.digests_follow:
            self.digests.append(digest)
        return {**bucket.to_info(self.path), "kind": "receive", "digest": digest, "previous_digest": previous}

    def add_digest(self, digest: str) -> None:
        """The digest of the bucket declared last (a `digests_follow` push)."""
        if not self.digests_follow:
            raise WeightSetRejected("a bucket digest after its declaration, in a push whose declarations carry them")
        if len(self.digests) >= len(self.buckets):
            raise WeightSetRejected("a bucket digest with no bucket declared and awaiting it")
        if not _DIGEST.fullmatch(digest):
            raise WeightSetRejected("bucket digest is not sha256:<64 hex> or sum64:<48 hex>")
        self.digests.append(digest)

    def last_digest(self) -> str:
        """What the worker checks the last received bucket against at the flush ("" where declarations
        carried the digests)."""
        if not self.digests_follow or not self.buckets:
            return ""
        self._require_digests()
        return self.digests[-1]

    def _require_digests(self) -> None:
        if len(self.digests) < len(self.buckets):
            raise WeightSetRejected(f"the digest of bucket {len(self.digests)} did not follow it")

    def commit(self, checksum: str) -> WeightSpool:
        if self._next != len(self.specs):
            raise WeightSetRejected(f"push ended after {self._next} of {len(self.specs)} tensors")
        self._require_digests()
        expected = set_checksum(self.specs, self.digests)
        if expected != checksum:
            raise WeightSetRejected(f"checksum {expected[:12]} != declared {checksum[:12]}")
        return WeightSpool(self.path, list(self.buckets))

    def abort(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


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
        from services.weightsync.wire import tensor_views

        where = self._where.get((path, offset))
        if where is None:
            return None
        start, n = where
        if n != sum(s.nbytes for s in specs):
            raise ValueError(f"bucket at {offset} staged {n} bytes, its specs take {sum(s.nbytes for s in specs)}")
        return tensor_views(specs, self._buffer[start : start + n])
