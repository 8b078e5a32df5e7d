"""The bucket producer: boundaries, a tensor larger than a bucket, per-bucket digests chained into the set
checksum (`set-sha256:`), and a set checksum equal to the one computed over the whole set."""

import hashlib

import pytest
import torch

from services.common.weight_buckets import TensorWeights, plan_buckets
from services.common.weight_spool import SpoolWriter
from services.common.weights import SET_SHA256, TensorSpec, checksum, pack, spec_of


def tensors():
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(10, generator=g)),  # 40 bytes
        ("b", torch.randn(10, generator=g)),  # 40
        ("c", torch.randn(5, 2, generator=g).to(torch.bfloat16)),  # 20
        ("big", torch.randn(50, generator=g)),  # 200: larger than a bucket
        ("empty", torch.zeros(0)),
        ("d", torch.randn(2, generator=g)),  # 8
    ]


def test_buckets_hold_whole_tensors_up_to_the_size_and_a_larger_tensor_alone():
    specs = [spec_of(n, t) for n, t in tensors()]
    plan = [[s.name for s in bucket] for bucket in plan_buckets(specs, 100)]
    assert plan == [["a", "b", "c"], ["big"], ["empty", "d"]]
    assert [[s.name for s in b] for b in plan_buckets(specs, 1)] == [["a"], ["b"], ["c"], ["big"], ["empty"], ["d"]]
    with pytest.raises(ValueError):
        plan_buckets(specs, 0)


@pytest.mark.parametrize("bucket_bytes", [1, 64, 100, 1 << 20])
def test_bucket_bytes_are_the_tensors_in_order_with_their_sha_and_the_set_checksum(bucket_bytes):
    weights = TensorWeights.of(tensors())
    assert weights.checksum == ""
    buckets = list(weights.buckets(bucket_bytes))
    joined = b"".join(bytes(b.data) for b in buckets)
    assert joined == pack(tensors()).payload
    assert all(b.nbytes <= bucket_bytes or len(b.specs) == 1 for b in buckets)
    assert weights.checksum == checksum(tensors()) == pack(tensors()).checksum
    # each digest is the set checksum over every tensor up to the bucket's last: the last one is the set's
    sent = 0
    for b in buckets:
        sent += len(b.specs)
        assert b.sha256 == "" and b.check == b.digest == SET_SHA256 + checksum(tensors()[:sent])
    assert buckets[-1].digest == SET_SHA256 + weights.checksum
    packed = list(pack(tensors()).buckets(bucket_bytes))  # a packed set's buckets carry their own sha256
    assert all(b.check == b.sha256 == hashlib.sha256(b.data).hexdigest() for b in packed)
    assert [(b.specs, bytes(b.data)) for b in packed] == [(b.specs, bytes(b.data)) for b in buckets]


def test_a_source_that_disagrees_with_its_specs_fails():
    specs = [spec_of(n, t) for n, t in tensors()]
    for other in (lambda t: t.long(), lambda t: t.reshape(-1, 1), lambda t: t.to(torch.complex64)):
        wrong = TensorWeights(specs, lambda other=other: [(n, other(t)) for n, t in tensors()])
        with pytest.raises(ValueError, match="expected"):
            list(wrong.buckets(100))
    ints = [("i", torch.arange(4))]
    as_float = TensorWeights([TensorSpec("i", "float32", (4,), 16)], lambda: ints)  # not a float source
    with pytest.raises(ValueError, match="expected"):
        list(as_float.buckets(100))
    short = TensorWeights(specs, lambda: tensors()[:-1])
    with pytest.raises(ValueError, match="expected"):
        list(short.buckets(100))
    longer = TensorWeights(specs, lambda: tensors() + [("x", torch.zeros(1))])
    with pytest.raises(ValueError, match="more tensors"):
        list(longer.buckets(100))


def test_a_float_source_held_in_another_dtype_is_cast_to_its_spec_on_the_way():
    stored = [(n, t.double() if t.is_floating_point() else t) for n, t in tensors()]
    sent = [(n, t.to(torch.bfloat16)) for n, t in stored]
    weights = TensorWeights([spec_of(n, t) for n, t in sent], lambda: stored)
    buckets = list(weights.buckets(64))
    assert b"".join(bytes(b.data) for b in buckets) == pack(sent).payload
    assert weights.checksum == checksum(sent)


def test_a_set_of_plain_tensors_is_stable_and_a_source_alone_is_not():
    named = tensors()
    assert all(a is b for a, (_, b) in zip(TensorWeights.of(named).stable_tensors(), named, strict=True))
    assert TensorWeights([spec_of(n, t) for n, t in named], lambda: named).stable_tensors() is None


def test_a_spool_gives_back_every_tensor_bucket_by_bucket(tmp_path):
    with SpoolWriter(str(tmp_path)) as writer:
        for bucket in TensorWeights.of(tensors()).buckets(64):
            writer.add(bucket.specs, bucket.data)
    spool = writer.finish()
    assert all(b.offset % 4096 == 0 for b in spool.buckets)
    back = list(spool.named_tensors())
    assert [n for n, _ in back] == [n for n, _ in tensors()]
    assert all(torch.equal(r, t) and r.dtype == t.dtype for (_, r), (_, t) in zip(back, tensors()))
    spool.delete()
    assert list(tmp_path.iterdir()) == []


def test_a_writer_left_by_an_error_deletes_its_file(tmp_path):
    with pytest.raises(RuntimeError), SpoolWriter(str(tmp_path)) as writer:
        writer.add([TensorSpec("a", "float32", (1,), 4)], b"\0" * 4)
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_a_set_teed_to_a_spool_is_sent_again_bucket_for_bucket(tmp_path):
    from services.common.weight_spool import TeeToSpool

    tee = TeeToSpool(TensorWeights.of(tensors()), str(tmp_path))
    first = [(b.specs, bytes(b.data), b.digest) for b in tee.buckets(64)]
    again = tee.spooled()
    assert again.checksum == checksum(tensors())
    assert [(b.specs, bytes(b.data), b.digest) for b in again.buckets(64)] == first
    again.spool.delete()
    assert list(tmp_path.iterdir()) == []
