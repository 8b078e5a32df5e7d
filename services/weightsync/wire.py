"""The wire format of a weight set: each tensor's spec (name, dtype, shape, bytes), the set checksum, the
served model's signature a pushed set must match, and the checks a receiver runs on the tensors it rebuilds
from bytes (views, finite values).

The checksum covers names, dtypes, shapes and bytes in order, so the learner and a rollout server
that computed the same value hold the same weights. A set as buckets, or as one byte string (`pack`), is
in `buckets`."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

CHUNK_BYTES = 1 << 20  # stays under gRPC's default 4 MiB message cap


def raw_bytes(t: torch.Tensor) -> bytes:
    """`t`'s bytes as they travel: contiguous, on the host, in its own dtype."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class SetHasher:
    """The set checksum, fed tensor by tensor (so also bucket by bucket)."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, spec: TensorSpec, data: bytes) -> None:
        self.start(spec)
        self._h.update(data)

    def start(self, spec: TensorSpec) -> None:
        """A tensor begins: its name, dtype and shape; its bytes follow through `update` (in pieces)."""
        self._h.update(f"{spec.name}\0{spec.dtype}\0{list(spec.shape)}\0".encode())

    def update(self, data) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def running(self) -> str:
        """The `set-sha256:` bucket digest: the checksum of the set fed so far (a bucket's digest when fed
        up to its last tensor). The hash state is copied, so feeding goes on."""
        return SET_SHA256 + self._h.copy().hexdigest()


SET_SHA256 = "set-sha256:"
"""Prefix of a bucket digest chained into the set checksum (see `buckets`)."""


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, _dtype_name(t), tuple(t.shape), t.numel() * t.element_size())


@functools.cache
def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype a spec's dtype names (looked up once a name: a lookup a tensor on every push)."""
    dtype = _torch_dtype(name)
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def fits_spec(name: str, t: torch.Tensor, spec: TensorSpec) -> bool:
    """Whether a source's tensor is sent as `spec`: same name and shape, and the spec's dtype or, for a
    floating-point tensor, a floating-point wire dtype (the tensor is cast where its bucket is packed, so a
    fp32 model is sent as bf16 without a cast and an allocation a tensor)."""
    if name != spec.name or tuple(t.shape) != tuple(spec.shape):
        return False
    wire = wire_dtype(spec.dtype)
    if t.dtype != wire and not (t.is_floating_point() and wire.is_floating_point):
        return False
    return t.numel() * wire.itemsize == spec.nbytes


def check_source(name: str | None, t: torch.Tensor | None, spec: TensorSpec) -> None:
    """Raises ValueError unless the source yielded a tensor that `fits_spec`."""
    if name is None or not fits_spec(name, t, spec):
        raise ValueError(f"weight source yielded {name!r}, expected {spec}")


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    hasher = SetHasher()
    for name, t in named_tensors:
        hasher.add(spec_of(name, t), raw_bytes(t))
    return hasher.hexdigest()


class WeightSetRejected(ValueError):
    """A pushed set that does not fit the served model; the message names the first bad tensor."""


def _torch_dtype(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass(frozen=True)
class ModelSignature:
    """Name -> (dtype, shape) of every tensor a served model takes: a pushed set must match it exactly,
    so a set that checks out here has exactly `total_bytes` of data."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]

    @classmethod
    def of(cls, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> ModelSignature:
        return cls({name: (_dtype_name(t), tuple(t.shape)) for name, t in named_tensors})

    @classmethod
    def of_pretrained(cls, path: str, dtype: str) -> ModelSignature:
        """The Hugging Face state-dict names and shapes of the model at `path` (built on the meta
        device: no memory, no weights read), in the served `dtype`: what the learner pushes."""
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        return cls({name: (dtype, tuple(t.shape)) for name, t in model.state_dict().items()})

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(dtype, shape) for dtype, shape in self.tensors.values())

    def check(self, specs: Sequence[TensorSpec]) -> None:
        """Raises WeightSetRejected unless `specs` is exactly this model's set (any order)."""
        if not specs:
            raise WeightSetRejected("empty weight set")
        declared = sum(s.nbytes for s in specs)
        seen: set[str] = set()
        for spec in specs:
            if spec.name in seen:
                raise WeightSetRejected(f"tensor {spec.name!r} appears twice")
            seen.add(spec.name)
            if spec.name not in self.tensors:
                raise WeightSetRejected(f"tensor {spec.name!r} is not a parameter of the served model")
            dtype, shape = self.tensors[spec.name]
            if spec.dtype != dtype:
                raise WeightSetRejected(f"tensor {spec.name!r}: dtype {spec.dtype}, the served model has {dtype}")
            if tuple(spec.shape) != shape:
                raise WeightSetRejected(
                    f"tensor {spec.name!r}: shape {list(spec.shape)}, the served model has {list(shape)}"
                )
            if spec.nbytes != _nbytes(dtype, shape):
                raise WeightSetRejected(
                    f"tensor {spec.name!r}: declares {spec.nbytes} bytes, "
                    f"its shape and dtype take {_nbytes(dtype, shape)}"
                )
        missing = [name for name in self.tensors if name not in seen]
        if missing:
            raise WeightSetRejected(
                f"incomplete weight set: {len(missing)} of {len(self.tensors)} tensors missing, first {missing[0]!r}"
            )
        if declared > self.total_bytes:  # unreachable after the checks above; kept as the stated bound
            raise WeightSetRejected(f"declares {declared} bytes, the served model has {self.total_bytes}")


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    torch_dtype = _torch_dtype(dtype)
    if torch_dtype is None:
        raise WeightSetRejected(f"unknown dtype {dtype!r}")
    return numel * torch.empty(0, dtype=torch_dtype).element_size()


def tensor_views(specs: Sequence[TensorSpec], flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The tensors laid end to end in `flat` (uint8) as views of it, no copy. Tensors of one dtype (the
    usual bucket) are cut by one `split` of the typed buffer: one op for the bucket and a `view` per
    tensor, where slicing, retyping and reshaping each cost three (host time that outweighed a small
    model's transfer)."""
    dtypes = {s.dtype for s in specs}
    if len(dtypes) == 1 and flat.numel():
        dtype = getattr(torch, dtypes.pop())
        size = torch.empty(0, dtype=dtype).element_size()
        if flat.storage_offset() % size == 0 and flat.numel() % size == 0:
            parts = flat.view(dtype).split([s.nbytes // size for s in specs])
            return [(s.name, part.view(tuple(s.shape))) for s, part in zip(specs, parts, strict=True)]
    out, offset = [], 0
    for s in specs:
        dtype = getattr(torch, s.dtype)
        view = flat[offset : offset + s.nbytes].view(dtype) if s.nbytes else torch.empty(0, dtype=dtype)
        out.append((s.name, view.reshape(tuple(s.shape))))
        offset += s.nbytes
    return out


def check_finite(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raises WeightSetRejected naming the first tensor holding a NaN or an infinity.

    A float32 sum per tensor first, stacked and read once: any NaN or infinity makes a sum non-finite
    (IEEE arithmetic propagates them), so finite sums clear every tensor with one read back (one host
    sync per bucket on a GPU, not one per tensor); a non-finite sum (or an overflow of huge finite
    values) is confirmed element by element. `isfinite(t).all()` alone writes a bool per element and is
    several times slower."""
    floats = [(name, t) for name, t in named_tensors if t.is_floating_point() and t.numel()]
    if not floats:
        return
    sums = torch.stack([t.sum(dtype=torch.float32) for _, t in floats])
    if bool(torch.isfinite(sums).all()):
        return
    for (name, t), total in zip(floats, sums.tolist(), strict=True):
        if not math.isfinite(total) and not bool(torch.isfinite(t).all()):
            raise WeightSetRejected(f"tensor {name!r} holds NaN or Inf values")
