"""A named-tensor set as a byte stream: the wire form of a weight push, with its checksum.

The checksum covers names, dtypes, shapes and bytes in order, so the learner and a rollout server
that computed the same value hold the same weights."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

CHUNK_BYTES = 1 << 20  # stays under gRPC's default 4 MiB message cap


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class _Hasher:
    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def add(self, spec: TensorSpec, data: bytes) -> None:
        self._h.update(f"{spec.name}\0{spec.dtype}\0{list(spec.shape)}\0".encode())
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, _dtype_name(t), tuple(t.shape), t.numel() * t.element_size())


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    hasher = _Hasher()
    for name, t in named_tensors:
        hasher.add(spec_of(name, t), _raw(t))
    return hasher.hexdigest()


@dataclass
class PackedWeights:
    specs: list[TensorSpec]
    checksum: str
    payload: bytes

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[bytes]:
        view = memoryview(self.payload)
        for start in range(0, len(view), size):
            yield bytes(view[start:start + size])


def pack(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> PackedWeights:
    hasher, specs, parts = _Hasher(), [], []
    for name, t in named_tensors:
        spec, data = spec_of(name, t), _raw(t)
        hasher.add(spec, data)
        specs.append(spec)
        parts.append(data)
    return PackedWeights(specs, hasher.hexdigest(), b"".join(parts))


class ChecksumMismatch(ValueError):
    pass


def unpack(specs: Sequence[TensorSpec], payload: bytes, expected_checksum: str) -> list[tuple[str, torch.Tensor]]:
    """Rebuilds tensors from the bytes; raises before returning anything if sizes or checksum differ."""
    total = sum(s.nbytes for s in specs)
    if total != len(payload):
        raise ChecksumMismatch(f"expected {total} bytes of tensors, received {len(payload)}")
    hasher, out, offset = _Hasher(), [], 0
    buffer = bytearray(payload)
    for spec in specs:
        data = memoryview(buffer)[offset:offset + spec.nbytes]
        hasher.add(spec, data)
        flat = torch.frombuffer(data, dtype=torch.uint8) if spec.nbytes else torch.empty(0, dtype=torch.uint8)
        out.append((spec.name, flat.view(getattr(torch, spec.dtype)).reshape(spec.shape)))
        offset += spec.nbytes
    if hasher.hexdigest() != expected_checksum:
        raise ChecksumMismatch(f"checksum {hasher.hexdigest()[:12]} != expected {expected_checksum[:12]}")
    return out
