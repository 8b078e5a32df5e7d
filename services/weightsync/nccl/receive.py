"""The receiving side of an `nccl` push's data plane: in each rollout engine worker (the vLLM engine,
`services/engines/vllm_nccl_engine.py`) or a plain Hugging Face receiver (`bench/weight_sync_gpu.py`),
each bucket is received by broadcast into one of two reused buffers and checked (digest, finite values)
before its tensors are handed out (`BucketReceiver`); `ParamCopier` applies them to named parameters."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from services.weightsync.digest import checked_digest_as, digest_algorithm, whole_dtype
from services.weightsync.nccl.group import Group
from services.weightsync.wire import TensorSpec, WeightSetRejected, check_finite, tensor_views


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
        whole = views.whole if views is not None else whole_dtype(specs, buffer)
        got, finite = checked_digest_as(buffer, whole)
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
