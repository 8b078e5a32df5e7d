"""The receiving end of a `grpc` weight push, in the rollout server (the sending end is `grpc.send`): every
bucket is checked as it arrives and parked in a spool file, so memory holds one bucket and nothing reaches
the engine before the whole set verified.

Order of a push: header (checked against the served model by `RolloutCore.admit` before this exists),
then per bucket its declaration (specs, size, and its check: the `set-sha256:` digest, or the sha256 of
its bytes from older senders) and data, then a commit carrying the set checksum.
A bucket must declare exactly the next tensors of the header, in order, and at most the header's bucket
size (a larger tensor travels alone: `buckets.check_declaration`); data past the declared size is refused
at the chunk that overflows. Any refusal, or a stream that ends without its commit, deletes the spool."""

from __future__ import annotations

import functools
import hashlib
import queue
import re
import threading
from collections.abc import Sequence

import torch

from services.weightsync.buckets import check_declaration, check_header_sizes
from services.weightsync.spool import SpoolWriter, WeightSpool
from services.weightsync.wire import (
    SET_SHA256,
    SetHasher,
    TensorSpec,
    WeightSetRejected,
    check_finite,
    tensor_views,
)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SET_SHA256 = re.compile(re.escape(SET_SHA256) + r"[0-9a-f]{64}")


class _Worker:
    """One thread that runs the receiver's per-byte work (hashing, spool writes) in order, while the event
    loop receives the next chunks. The first error stops it; `drain()` waits for what was queued and
    raises that error."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weight-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            if self._error is None:
                try:
                    task()
                except BaseException as exc:  # noqa: BLE001 - raised to the receiver at its next drain
                    self._error = exc

    def submit(self, task) -> None:
        self._tasks.put(task)

    def drain(self) -> None:
        if not self._thread.is_alive():
            raise WeightSetRejected("the push was already ended (refused or aborted)")
        done = threading.Event()
        self._tasks.put(done.set)
        done.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        if self._thread.is_alive():
            self._tasks.put(None)
            self._thread.join()


class BucketReceiver:
    """A bucket's bytes are copied into one reused buffer as they arrive; a worker thread hashes them and
    appends them to the spool meanwhile, so the checks of a bucket end shortly after its last chunk. A
    bucket is verified (digest, then finite values) when the next one is declared or at the commit:
    before anything more is accepted, and always before the set can be applied."""

    def __init__(self, specs: Sequence[TensorSpec], bucket_bytes: int, total_bytes: int, spool_dir: str | None = None):
        check_header_sizes(specs, bucket_bytes, total_bytes)
        self.specs, self.bucket_bytes = list(specs), bucket_bytes
        self.received = 0
        self._next = 0  # index of the first tensor not yet declared by a bucket
        self._hasher = SetHasher()
        self._buffer: memoryview | None = None
        self._bucket: tuple[tuple[TensorSpec, ...], str] | None = None
        self._bucket_sha = None  # a bucket checked by the sha256 of its bytes: their hash
        self._reusable = bytearray()
        self._filled = 0
        self._spool = SpoolWriter(spool_dir)
        self._worker = _Worker()
        self._fed = _FeedPosition()

    def start_bucket(self, specs: Sequence[TensorSpec], nbytes: int, check: str) -> None:
        """`check`: the bucket's `set-sha256:<hex>` digest, or the sha256 of its bytes (64 hex digits)."""
        self._close_bucket()
        expected = check_declaration(self.specs, self._next, specs, nbytes, self.bucket_bytes)
        if not (_SHA256.fullmatch(check) or _SET_SHA256.fullmatch(check)):
            raise WeightSetRejected("bucket check is neither 64 lowercase hex digits nor set-sha256:<64 hex>")
        self._next += len(expected)
        if len(self._reusable) < nbytes:  # one buffer for every bucket: no page faults per bucket
            self._reusable = bytearray(nbytes)
        self._bucket, self._buffer, self._filled = (tuple(expected), check), memoryview(self._reusable)[:nbytes], 0
        self._bucket_sha = None if check.startswith(SET_SHA256) else hashlib.sha256()
        self._fed = _FeedPosition()
        self._worker.submit(functools.partial(self._spool.start, expected))

    def add_data(self, data: bytes) -> None:
        if self._buffer is None:
            raise WeightSetRejected("data before any bucket declaration")
        start, end = self._filled, self._filled + len(data)
        if end > len(self._buffer):
            raise WeightSetRejected(f"more data than the {len(self._buffer)} bytes its bucket declared")
        self._buffer[start:end] = data
        self._filled = end
        (specs, _), fed, sha = self._bucket, self._fed, self._bucket_sha
        self._worker.submit(functools.partial(self._feed, specs, self._buffer, fed, sha, start, end))

    def _feed(self, specs, buffer: memoryview, fed: _FeedPosition, sha, start: int, end: int) -> None:
        """Worker thread: bytes `start:end` of the open bucket to its hashes and the spool."""
        piece = buffer[start:end]
        if sha is not None:
            sha.update(piece)
        fed.feed(self._hasher, specs, buffer, end)
        self._spool.write(piece)

    def _close_bucket(self) -> None:
        if self._bucket is None:
            return
        (specs, check), buffer = self._bucket, self._buffer
        if self._filled != len(buffer):
            raise WeightSetRejected(f"bucket of {specs[0].name!r}: {self._filled} of {len(buffer)} bytes received")
        self._worker.submit(functools.partial(self._fed.feed, self._hasher, specs, buffer, len(buffer)))
        self._worker.drain()
        # The set checksum was fed before the bucket's check is compared: a mismatch ends the push anyway.
        if self._bucket_sha is None:
            if self._hasher.running() != check:
                raise WeightSetRejected(f"bucket of {specs[0].name!r}: its bytes do not match its set-sha256 digest")
        elif self._bucket_sha.hexdigest() != check:
            raise WeightSetRejected(f"bucket of {specs[0].name!r}: sha256 does not match its bytes")
        flat = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
        check_finite(tensor_views(specs, flat))
        self.received += len(buffer)
        self._bucket, self._buffer = None, None

    def commit(self, checksum: str) -> WeightSpool:
        """Closes the last bucket and checks the set is whole and matches `checksum`; the caller owns
        (and deletes) the returned spool."""
        self._close_bucket()
        self._worker.stop()
        if self._next != len(self.specs):
            raise WeightSetRejected(f"push ended after {self._next} of {len(self.specs)} tensors")
        if self._hasher.hexdigest() != checksum:
            raise WeightSetRejected(f"checksum {self._hasher.hexdigest()[:12]} != declared {checksum[:12]}")
        return self._spool.finish()

    def abort(self) -> None:
        self._worker.stop()
        self._bucket, self._buffer, self._reusable = None, None, bytearray()
        self._spool.discard()


class _FeedPosition:
    """How far the set checksum has been fed through the open bucket: each tensor's name, dtype and shape
    go in where its bytes start (an empty tensor's where it sits), then its bytes as they arrive."""

    def __init__(self) -> None:
        self.index, self.start, self.at, self.opened = 0, 0, 0, False

    def feed(self, hasher: SetHasher, specs: Sequence[TensorSpec], buffer, end: int) -> None:
        """Feeds the bytes up to `end`, and the name, dtype and shape of every tensor starting there."""
        while self.index < len(specs):
            spec = specs[self.index]
            if not self.opened:
                hasher.start(spec)
                self.opened = True
            stop = min(end, self.start + spec.nbytes)
            if stop > self.at:
                hasher.update(buffer[self.at : stop])
                self.at = stop
            if self.at < self.start + spec.nbytes:
                return
            self.index, self.start, self.opened = self.index + 1, self.start + spec.nbytes, False
