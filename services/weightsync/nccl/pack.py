"""The sending side of an `nccl` push's data plane, on the learner: the set's buckets packed on the learner's
device (`pack_buckets`; `BucketPacker` keeps the layout of a set that stays put), each bucket's broadcast
posted to every server's group while the next is packed (`SendWindow`). The pusher is `send`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from services.weightsync.buckets import plan_buckets
from services.weightsync.digest import bucket_digest
from services.weightsync.wire import TensorSpec, check_source, wire_dtype


@dataclass
class DeviceBucket:
    specs: tuple[TensorSpec, ...]
    data: torch.Tensor  # uint8, on the group's device
    digest: str

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    specs: Sequence[TensorSpec],
    bucket_bytes: int,
    device,
    *,
    slots: int | None = None,
    digest: bool = True,
) -> Iterator[DeviceBucket]:
    """Buckets of `named_tensors` (which must yield exactly `specs` in order; a float tensor may be held in another
    float dtype, it is cast as it is copied in: `wire.fits_spec`) packed on `device`, each with its digest (or ""
    with `digest=False`: a sender that digests a bucket while it moves). `slots=None`: a new buffer per bucket (one
    alive at a time unless the caller keeps them). `slots=2`: the buckets take turns in two buffers allocated once
    (bucket k+2 is packed into bucket k's), for a sender that posts bucket k's broadcast and packs bucket k+1 while
    it runs: the caller must have waited for every send of bucket k (`work.wait()`, on NCCL a stream wait, no host
    sync) before it asks for bucket k+2 (`SendWindow` does that)."""
    it = iter(named_tensors)
    slot_buffers = _Slots(slots, device)
    for k, planned in enumerate(plan_buckets(specs, bucket_bytes)):
        buffer = slot_buffers.take(k, sum(s.nbytes for s in planned))
        pending: list[torch.Tensor] = []
        wires: list[torch.dtype] = []
        start = end = 0  # the bucket's bytes [start, end) are pending
        for spec in planned:
            name, t = next(it, (None, None))
            check_source(name, t, spec)
            if spec.nbytes:
                pending.append(t.to(device).reshape(-1))
                wires.append(wire_dtype(spec.dtype))
                end += spec.nbytes
            if (end - start) * 4 >= bucket_bytes:  # gathered sources held at most a quarter of a bucket
                _copy_pending(pending, wires, buffer[start:end])
                start = end
        _copy_pending(pending, wires, buffer[start:end])
        yield DeviceBucket(planned, buffer, bucket_digest(buffer) if digest else "")
    if next(it, None) is not None:
        raise ValueError("weight source yielded more tensors than its specs declare")


class _Slots:
    """The buffers buckets are packed into: `slots` reused in turn (grown when a bucket needs more), or
    with `slots=None` a new one a bucket."""

    def __init__(self, slots: int | None, device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None] * (slots or 0)

    def take(self, k: int, nbytes: int) -> torch.Tensor:
        if not self.buffers:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        slot = k % len(self.buffers)
        held = self.buffers[slot]
        if held is None or held.numel() < nbytes:
            self.buffers[slot] = None  # release the smaller one first
            held = self.buffers[slot] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return held[:nbytes]


class BucketPacker:
    """`pack_buckets(slots=2)` for a sender that pushes the same set again and again (the nccl pusher keeps
    one). A set whose tensors stay put (`TensorWeights.stable_tensors`: plain tensors, a one-process FSDP
    mesh) is laid out once: per bucket, the flat views of its tensors and the dtype the bucket is viewed
    as; each push is then one copy per bucket (`_Packed.copy_to`) and its digest, no host work a tensor.
    The layout is rebuilt when the specs change or a tensor's storage moved (its `data_ptr`: the layout's
    views keep the old storage alive until the next push rebuilds it or `release`, so an equal pointer is
    the same memory; an optimizer's in-place step keeps it). A set that gathers, holds a tensor on another
    device or a strided one, or mixes dtypes that need a cast within one bucket streams through
    `pack_buckets`."""

    def __init__(self, bucket_bytes: int, device, slots: int | None = 2):
        self.bucket_bytes, self.device, self.slots = bucket_bytes, torch.device(device), slots
        self.builds = 0  # layouts built (a test's and a log's view of the cache)
        self._layout: _Layout | None = None

    def buckets(self, weights, *, digest: bool = True) -> Iterator[DeviceBucket]:
        stable = getattr(weights, "stable_tensors", None)
        tensors = stable() if stable is not None else None
        layout = self._layout_for(weights.specs, tensors) if tensors is not None else None
        if layout is None or layout.buckets is None:
            yield from pack_buckets(
                weights.named_tensors(), weights.specs, self.bucket_bytes, self.device, slots=self.slots, digest=digest
            )
        else:
            yield from layout.pack(self.slots, digest)

    def release(self) -> None:
        """Forgets the layout (and the storage its views hold)."""
        self._layout = None

    def _layout_for(self, specs: Sequence[TensorSpec], tensors: Sequence[torch.Tensor]) -> _Layout:
        ptrs = [t.data_ptr() for t in tensors]
        layout = self._layout
        if layout is None or layout.ptrs != ptrs or layout.specs != specs:
            self._layout = None  # the old views go before the new are made
            layout = self._layout = _Layout.build(specs, tensors, ptrs, self.bucket_bytes, self.device)
            self.builds += 1
        return layout


@dataclass
class _Packed:
    """One bucket of a `_Layout`: its flat sources, copied into the bucket's bytes viewed as `dtype`."""

    specs: tuple[TensorSpec, ...]
    nbytes: int
    sources: list[torch.Tensor]
    dtype: torch.dtype

    def __post_init__(self):
        self.cast = any(t.dtype != self.dtype for t in self.sources)
        self.numels = [t.numel() for t in self.sources]

    def copy_to(self, buffer: torch.Tensor) -> None:
        """The sources into `buffer` (the bucket's bytes). Of one dtype: one `torch.cat`. Held in another
        float dtype (fp32 master weights sent as bf16): one multi-tensor copy into the bucket's views, which
        casts in a few launches, where a casting `cat` copies tensor by tensor (2 x H200, the 0.5B set:
        1.1 ms and 0.3 ms of host time against 2.1 and 1.9 ms)."""
        with torch.no_grad():
            if self.cast:
                torch._foreach_copy_(list(buffer.view(self.dtype).split(self.numels)), self.sources)
            else:
                torch.cat(self.sources, out=buffer.view(self.dtype))


@dataclass
class _Layout:
    specs: list[TensorSpec]
    ptrs: list[int]
    device: torch.device
    buckets: list[_Packed] | None  # None: the set cannot be laid out (see `BucketPacker`)

    @classmethod
    def build(cls, specs, tensors, ptrs, bucket_bytes: int, device: torch.device) -> _Layout:
        if len(tensors) != len(specs):
            raise ValueError(f"weight source holds {len(tensors)} tensors, its specs declare {len(specs)}")
        for spec, t in zip(specs, tensors, strict=True):
            check_source(spec.name, t, spec)
        device = torch.empty(0, device=device).device  # `cuda` as the index it allocates on
        layout = cls(list(specs), ptrs, device, [])
        at = 0
        for planned in plan_buckets(specs, bucket_bytes):
            packed = _packed(planned, tensors[at : at + len(planned)], device)
            at += len(planned)
            if packed is None:
                layout.buckets = None
                break
            layout.buckets.append(packed)
        return layout

    def pack(self, slots: int | None, digest: bool = True) -> Iterator[DeviceBucket]:
        slot_buffers = _Slots(slots, self.device)
        for k, b in enumerate(self.buckets):
            buffer = slot_buffers.take(k, b.nbytes)
            if b.sources:
                b.copy_to(buffer)
            yield DeviceBucket(b.specs, buffer, bucket_digest(buffer) if digest else "")


def _packed(specs: tuple[TensorSpec, ...], tensors: Sequence[torch.Tensor], device: torch.device) -> _Packed | None:
    """A bucket's cached copy, or None where its tensors cannot be read in place by one copy: on another
    device, strided (flattening copies it), or of mixed wire dtypes with one needing a cast."""
    kept = [(s, t) for s, t in zip(specs, tensors, strict=True) if s.nbytes]
    if any(t.device != device or not t.is_contiguous() for _, t in kept):
        return None
    kept = [(s, t.detach().reshape(-1)) for s, t in kept]
    nbytes = sum(s.nbytes for s in specs)
    wires = {wire_dtype(s.dtype) for s, _ in kept}
    if len(wires) == 1:
        return _Packed(specs, nbytes, [t for _, t in kept], wires.pop())
    if any(t.dtype != wire_dtype(s.dtype) for s, t in kept):
        return None
    return _Packed(specs, nbytes, [t.view(torch.uint8) for _, t in kept], torch.uint8)


class SendWindow:
    """The sender's side of the pipeline with `pack_buckets(slots=2)`: once bucket k's broadcasts are
    posted (`add`), bucket k-1's are waited for (`settle`; on NCCL that orders the packing stream after
    them without a host sync, on gloo it blocks until they ended), so bucket k+1 is packed into k-1's
    buffer while bucket k is on the wire. `drain` waits for every posted one. Each work comes with a key
    (the group, the session) so a failure is charged to it."""

    def __init__(self):
        self._older: list[tuple[object, object]] = []
        self._newer: list[tuple[object, object]] = []

    def add(self, posted: list[tuple[object, object]]) -> None:
        """`(key, work)` of each broadcast of the bucket just posted; the one before becomes settleable."""
        self._older, self._newer = self._older + self._newer, list(posted)

    def settle(self) -> list[tuple[object, Exception]]:
        """Waits for the works of every bucket but the newest; `(key, error)` for each that failed."""
        older, self._older = self._older, []
        return _wait_all(older)

    def drain(self) -> list[tuple[object, Exception]]:
        older, self._older, self._newer = self._older + self._newer, [], []
        return _wait_all(older)


def _wait_all(posted: list[tuple[object, object]]) -> list[tuple[object, Exception]]:
    failed = []
    for key, work in posted:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - charged to its key (a group, a session) by the caller
            failed.append((key, exc))
    return failed


def _copy_pending(pending: list[torch.Tensor], wires: list[torch.dtype], target: torch.Tensor) -> None:
    """The gathered tensors (flat) laid end to end into `target` (bytes of the bucket) by one
    `torch.cat`: one batched copy, and a few microseconds of host time a tensor where typed views of
    the bucket and a multi-tensor copy took tens. Where their wire dtypes (`wires`) are one, the bucket
    is viewed as it (wide loads) and a float tensor held in another float dtype is cast by the cat itself
    (bit-identical to casting it first); else each is cast on its own and copied as bytes. Empties
    `pending` and `wires`."""
    if not pending:
        return
    wire = wires[0]
    if all(w == wire for w in wires) and target.storage_offset() % wire.itemsize == 0:
        sources, target = pending, target.view(wire)
    else:
        sources = [t.to(w).view(torch.uint8) for t, w in zip(pending, wires, strict=True)]
    with torch.no_grad():
        torch.cat(sources, out=target)
    pending.clear()
    wires.clear()
