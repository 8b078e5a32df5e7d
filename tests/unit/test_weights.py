import pytest
import torch

from services.common.weights import ChecksumMismatch, checksum, pack, unpack


def tensors():
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(7, 3, generator=g)),
            ("lm_head.weight", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
            ("model.norm.weight", torch.ones(3, dtype=torch.float16)),
            ("empty", torch.zeros(0))]


def test_round_trip_through_chunks_restores_every_tensor():
    packed = pack(tensors())
    restored = unpack(packed.specs, b"".join(packed.chunks(size=5)), packed.checksum)
    for (name, t), (rname, r) in zip(tensors(), restored):
        assert name == rname and r.dtype == t.dtype and torch.equal(r, t)


def test_checksum_covers_values_names_and_order():
    base = checksum(tensors())
    assert base == pack(tensors()).checksum
    changed = tensors()
    changed[0][1][0, 0] += 1e-3
    assert checksum(changed) != base
    renamed = tensors()
    renamed[2] = ("model.norm.bias", renamed[2][1])
    assert checksum(renamed) != base
    assert checksum(list(reversed(tensors()))) != base


def test_corrupted_or_short_payload_is_rejected_before_anything_is_returned():
    packed = pack(tensors())
    corrupted = bytearray(packed.payload)
    corrupted[3] ^= 0xFF
    with pytest.raises(ChecksumMismatch, match="checksum"):
        unpack(packed.specs, bytes(corrupted), packed.checksum)
    with pytest.raises(ChecksumMismatch, match="bytes"):
        unpack(packed.specs, packed.payload[:-1], packed.checksum)
