"""Weight buckets over a torch.distributed process group: the data plane of the `nccl` weight push.

One code path for CPU and GPU; only the process-group backend differs (gloo moves CPU tensors, nccl CUDA
tensors). The learner's rank 0 is rank 0 of a small group per rollout server (itself plus that server's
engine workers) and broadcasts each bucket to it; the control plane (credential, header, per-bucket
specs and digest, commit) stays on the authenticated gRPC stream, so every check runs before anything is
applied.

The groups are not torch's default group (the learner's FSDP world and each vLLM worker's own world
already are): they are built straight from a store (`ProcessGroupGloo` / `ProcessGroupNCCL`). The learner
hosts the `TCPStore` on the rendezvous port; every group lives under its own prefix, named by the
learner, so a broken group is replaced by a fresh one without restarting anything.

Bucket digest: `sha256:<hex>` of the bytes where the bucket is a CPU tensor (the gRPC path's digest), and
on CUDA `sum64:<hex>`: a wrapping int64 sum and a position-weighted sum of the bucket's 8-byte words,
computed on the device (one pass of a Triton kernel, `sum64_kernel`, no host copy). It catches
truncation, dropped or reordered words and random corruption; it is not a cryptographic hash (the bytes
come from an authenticated peer over a private network; the digest guards against transport faults, not
forgery).

Used by the learner's sender (`services/learner/weight_push/nccl_push.py`), by the vLLM engine
(`services/rollout/backends/vllm_dist_engine.py`) and by plain Hugging Face receivers
(`bench/weight_sync_gpu.py`)."""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from services.common.weight_buckets import plan_buckets
from services.common.weights import (
    TensorSpec,
    WeightSetRejected,
    check_finite,
    check_source,
    tensor_views,
    wire_dtype,
)

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets: the learner's store (`host`:`port`), the group's name (its store prefix), the
    backend, and the timeout of every collective and of joining."""

    host: str
    port: int
    group: str
    backend: str
    timeout_s: float

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"process-group backend must be one of {BACKENDS}, got {self.backend!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"rendezvous port {self.port} is not a TCP port")
        if not self.group or "/" in self.group:
            raise ValueError(f"group name {self.group!r} must be non-empty and hold no '/'")

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"


def backend_for(device: str | torch.device) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def open_store(host: str, port: int, *, master: bool, timeout_s: float) -> torch.distributed.Store:
    return torch.distributed.TCPStore(
        host, port, None, master, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


class Group:
    """One process group of a rendezvous: `broadcast` from rank 0. Rank 0 learns the world size from the
    receivers' rank 1 (`announce`), so the learner needs no knowledge of a server's parallelism."""

    def __init__(self, rdv: Rendezvous, store, rank: int, world_size: int):
        import torch.distributed as dist

        self.rdv, self.rank, self.world_size = rdv, rank, world_size
        self.store = dist.PrefixStore(f"omrl/{rdv.group}/", store)
        timeout = datetime.timedelta(seconds=rdv.timeout_s)
        if rdv.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            if hasattr(opts, "_timeout"):
                opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        self._timeout = timeout
        self.sessions = 0  # pushes the source started on this group

    @classmethod
    def join(cls, rdv: Rendezvous, rank: int, world_size: int) -> Group:
        """A receiver's side: announces the world size (rank 1), then joins; blocks until rank 0 joins."""
        import torch.distributed as dist

        store = open_store(rdv.host, rdv.port, master=False, timeout_s=rdv.timeout_s)
        if rank == 1:
            dist.PrefixStore(f"omrl/{rdv.group}/", store).set("world_size", str(world_size))
        return cls(rdv, store, rank, world_size)

    @classmethod
    def host(cls, rdv: Rendezvous, store, give_up: Callable[[], bool] = lambda: False) -> Group:
        """The source's side (rank 0) on the store it hosts: waits for the receivers' announcement (or
        until `give_up()`, or the timeout), then joins."""
        import torch.distributed as dist

        prefixed = dist.PrefixStore(f"omrl/{rdv.group}/", store)
        deadline = time.monotonic() + rdv.timeout_s
        while not prefixed.check(["world_size"]):
            if give_up():
                raise ConnectionError(f"group {rdv.group}: the receiver ended the push before joining")
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {rdv.group}: no receiver joined within {rdv.timeout_s:.0f}s")
            time.sleep(0.005)
        return cls(rdv, store, 0, int(prefixed.get("world_size")))

    def open_session(self) -> None:
        """A receiver's side: its session is open (counted in the store), buckets may come."""
        self.store.add("sessions", 1)

    def wait_session(self, give_up: Callable[[], bool] = lambda: False) -> None:
        """The source's side, before a push's first bucket: waits until the receivers opened one more
        session than before (the server accepted the push's header), so no broadcast waits on a receiver
        that refused the push."""
        self.sessions += 1
        deadline = time.monotonic() + self.rdv.timeout_s
        while int(self.store.add("sessions", 0)) < self.sessions:
            if give_up():
                raise ConnectionError(f"group {self.rdv.group}: the receiver ended the push before receiving")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"group {self.rdv.group}: the receiver opened no session in {self.rdv.timeout_s:.0f}s"
                )
            time.sleep(0.002)

    def broadcast(self, buffer: torch.Tensor) -> None:
        self.post(buffer).wait()

    def post(self, buffer: torch.Tensor):
        """Starts a broadcast from rank 0 into/out of `buffer`; the returned work's `wait()` ends it (on
        NCCL: orders the current CUDA stream after it)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, self._timeout
        return self.pg.broadcast([buffer], opts)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - a group whose peer died may not shut down cleanly
                pass


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
        from services.common import sum64_kernel

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
    return _checked_digest_as(buffer, _whole_dtype(specs, buffer))


def _checked_digest_as(buffer: torch.Tensor, dtype: torch.dtype | None) -> tuple[str, bool]:
    """`checked_digest` with the bucket's one floating dtype (`_whole_dtype`) already known."""
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


def _whole_dtype(specs: Sequence[TensorSpec], buffer: torch.Tensor) -> torch.dtype | None:
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
    float dtype, it is cast as it is copied in: `weights.fits_spec`) packed on `device`, each with its digest (or ""
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


@dataclass
class _Posted:
    """A bucket whose broadcast was posted and whose checks are still to be read."""

    specs: Sequence[TensorSpec]
    buffer: torch.Tensor
    slot: int
    work: object
    digest_of: Callable[[], str]


@dataclass
class _Views:
    """What a received bucket's specs give, kept per slot while the slot's buffer stays: the tensors as
    views of the buffer and the dtype its finite check sums it as."""

    specs: tuple[TensorSpec, ...]
    tensors: list[tuple[str, torch.Tensor]]
    whole: torch.dtype | None


_VIEWS_PER_SLOT = 1024  # distinct bucket layouts kept a slot (a set's buckets; more only if sets change)


def _views_key(specs: tuple[TensorSpec, ...], buffer: torch.Tensor) -> tuple[int, str]:
    return buffer.numel(), specs[0].name if specs else ""


class BucketReceiver:
    """The receiving end shared by the vLLM engine and plain Hugging Face receivers: receive a bucket
    into one of two reused buffers, check its digest and finite values, hand back its tensors. Nothing
    is applied here; a bucket that fails a check raises WeightSetRejected.

    `receive` takes one bucket and checks it. `post` + `flush` pipeline them: `post` starts bucket k's
    broadcast, then checks and returns bucket k-1 (None for the first), so on a GPU the transfer of k
    overlaps the checks and the apply of k-1; `flush` checks and returns the last posted one. Tensors
    handed out stay valid until the bucket after next is posted (it reuses their buffer; on a GPU, work
    queued on the current stream before that post is ordered before it). A bucket's digest and finite
    sum are read back together, one host sync a bucket (queuing them on a side stream and reading them
    through pinned memory and an event measured no faster on H200s: docs/weight-sync.md). The views of a
    bucket's tensors are made once per slot and bucket layout (its specs) and reused on later pushes
    while that slot's buffer is not reallocated: no host work a tensor on a push of the same set."""

    def __init__(self, group: Group):
        self.group = group
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._views: list[dict[tuple[int, str], _Views]] = [{}, {}]
        self._pending: _Posted | None = None
        self._posted = 0
        self.last: torch.Tensor | None = None
        """The bytes of the bucket last checked (a view of a reused buffer)."""

    def receive(self, specs: Sequence[TensorSpec], nbytes: int, digest: str) -> list[tuple[str, torch.Tensor]]:
        """One bucket: broadcast into a buffer, then its checks."""
        earlier = self.post(specs, nbytes, digest)
        if earlier is not None:
            raise RuntimeError("receive() after post() without flush()")
        return self.flush()

    def post(
        self, specs: Sequence[TensorSpec], nbytes: int, digest: str, previous_digest: str = ""
    ) -> list[tuple[str, torch.Tensor]] | None:
        """Starts bucket k's broadcast; returns bucket k-1's checked tensors (None if k is the first).
        Where digests follow their buckets, k is posted with `digest` "" and its digest comes as the
        `previous_digest` of the next post (or the flush), before it is checked."""
        self._follow(previous_digest)
        return self._post(specs, nbytes, lambda: digest)

    def _post(self, specs, nbytes: int, digest: Callable[[], str]) -> list[tuple[str, torch.Tensor]] | None:
        self._check_declared(specs, nbytes)
        slot = self._posted % 2
        buffer = self._slot(slot, nbytes)
        posted = _Posted(specs, buffer, slot, self.group.post(buffer), digest)
        self._posted += 1
        earlier, self._pending = self._pending, posted
        return None if earlier is None else self._verified(earlier)

    def flush(self, previous_digest: str = "") -> list[tuple[str, torch.Tensor]]:
        """Checks and returns the last posted bucket ([] if none is pending)."""
        self._follow(previous_digest)
        pending, self._pending = self._pending, None
        return [] if pending is None else self._verified(pending)

    def _follow(self, digest: str) -> None:
        """The pending bucket's digest, where it came after the bucket (a bucket left without one fails its
        check: no digest is no algorithm)."""
        if digest and self._pending is not None:
            self._pending.digest_of = lambda: digest

    @property
    def pending(self) -> bool:
        """A bucket was posted and not yet checked (`flush` has not run)."""
        return self._pending is not None

    def receive_all(
        self, declared: Iterable[tuple[Sequence[TensorSpec], int]], digest_of: Callable[[int], str]
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Every bucket of `declared` through `post`/`flush`, in order; `digest_of(i)` is asked for
        when bucket i is checked."""
        for i, (specs, nbytes) in enumerate(declared):
            tensors = self._post(specs, nbytes, functools.partial(digest_of, i))
            if tensors is not None:
                yield tensors
        if self._pending is not None:
            yield self.flush()

    def _check_declared(self, specs, nbytes: int) -> None:
        if nbytes != sum(s.nbytes for s in specs):
            raise WeightSetRejected(f"bucket declares {nbytes} bytes, its tensors take {sum(s.nbytes for s in specs)}")

    def _slot(self, slot: int, nbytes: int) -> torch.Tensor:
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            self._buffers[slot] = None  # release the smaller one first (and the views into it)
            self._views[slot].clear()
            buffer = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.rdv.device)
        return buffer[:nbytes]

    def _cached_views(self, slot: int, specs: tuple[TensorSpec, ...], buffer: torch.Tensor) -> _Views | None:
        """The bucket's views into its slot where an earlier bucket of these specs made them."""
        views = self._views[slot].get(_views_key(specs, buffer))
        return views if views is not None and views.specs == specs else None

    def _remember_views(self, slot: int, specs: tuple[TensorSpec, ...], buffer: torch.Tensor, whole) -> _Views:
        cache = self._views[slot]
        if len(cache) >= _VIEWS_PER_SLOT:
            cache.clear()
        views = cache[_views_key(specs, buffer)] = _Views(specs, tensor_views(specs, buffer), whole)
        return views

    def _verified(self, posted: _Posted) -> list[tuple[str, torch.Tensor]]:
        specs, buffer = posted.specs, posted.buffer
        posted.work.wait()
        digest = posted.digest_of()
        algorithm = digest.split(":", 1)[0]
        if algorithm != digest_algorithm(self.group.rdv.device):
            raise WeightSetRejected(f"bucket digest {algorithm!r} is not this group's ({self.group.rdv.backend})")
        specs = tuple(specs)
        views = self._cached_views(posted.slot, specs, buffer)
        whole = views.whole if views is not None else _whole_dtype(specs, buffer)
        got, finite = _checked_digest_as(buffer, whole)
        if got != digest:
            raise WeightSetRejected(f"bucket of {specs[0].name!r}: its bytes do not match the digest {digest[:20]}")
        if views is None:
            views = self._remember_views(posted.slot, specs, buffer, whole)
        if not finite:
            check_finite(views.tensors)
        self.last = buffer
        return list(views.tensors)

    def release(self) -> None:
        self._buffers, self._pending, self.last = [None, None], None, None
        self._views = [{}, {}]


def check_against(params: dict[str, torch.Tensor], specs: Sequence[TensorSpec]) -> None:
    """Every spec names a parameter of `params` with its shape and dtype (checked before any data moves)."""
    for s in specs:
        p = params.get(s.name)
        if p is None:
            raise WeightSetRejected(f"unknown tensor {s.name!r}")
        if tuple(p.shape) != tuple(s.shape) or str(p.dtype).removeprefix("torch.") != s.dtype:
            raise WeightSetRejected(f"{s.name!r}: {s.dtype}{list(s.shape)}, the model has {p.dtype}{list(p.shape)}")


class ParamCopier:
    """Applies received tensors into named parameters (a Hugging Face model's `state_dict()`) by one
    multi-tensor copy a bucket; a receiver that applies buckets of the same names on every push looks each
    bucket's list of target parameters up once (keyed by the bucket's names)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self.params = params
        self._targets: dict[tuple[str, ...], list[torch.Tensor]] = {}

    def __call__(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pairs = list(tensors)
        if not pairs:
            return
        names = tuple(name for name, _ in pairs)
        targets = self._targets.get(names)
        if targets is None:
            targets = self._targets[names] = [self.params[name] for name in names]
        with torch.no_grad():  # one multi-tensor copy, not a kernel launch per tensor
            torch._foreach_copy_(targets, [t for _, t in pairs], non_blocking=True)
