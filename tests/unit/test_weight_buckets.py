"""The bucket producer: boundaries, a tensor larger than a bucket, per-bucket digests chained into the set
checksum (`set-sha256:`), and a set checksum equal to the one computed over the whole set."""

import hashlib

import pytest
import torch

from services.weightsync.buckets import TensorWeights, pack, plan_buckets
from services.weightsync.spool import SpoolWriter
from services.weightsync.wire import SET_SHA256, TensorSpec, checksum, spec_of


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
    from services.weightsync.spool import TeeToSpool

    tee = TeeToSpool(TensorWeights.of(tensors()), str(tmp_path))
    first = [(b.specs, bytes(b.data), b.digest) for b in tee.buckets(64)]
    again = tee.spooled()
    assert again.checksum == checksum(tensors())
    assert [(b.specs, bytes(b.data), b.digest) for b in again.buckets(64)] == first
    again.spool.delete()
    assert list(tmp_path.iterdir()) == []


def test_a_stager_writes_each_bucket_at_its_offset_before_its_buffer_is_reused(tmp_path):
    """CPU buckets (the gloo path) are in the file when `stage` returns: the receiver reuses their buffer for
    the bucket after next. A write that fails raises (the push is refused before its commit)."""
    from services.weightsync.nccl.staging import BucketStager

    spool = tmp_path / "w.spool"
    spool.write_bytes(b"")
    sizes, offsets = (5000, 0, 4096, 17), (0, 8192, 8192, 16384)
    buckets = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n)) for n in sizes
    ]
    expected = [b.clone() for b in buckets]
    stager = BucketStager()
    for data, offset in zip(buckets, offsets, strict=True):
        stager.stage(str(spool), offset, data)
        data.zero_()  # the next receive into this buffer
    stager.drain()
    stager.close()
    written = spool.read_bytes()
    for data, offset in zip(expected, offsets, strict=True):
        assert written[offset : offset + data.numel()] == data.numpy().tobytes()
    with pytest.raises(FileNotFoundError):
        BucketStager().stage(str(tmp_path / "gone.spool"), 0, torch.ones(8, dtype=torch.uint8))


def test_an_arena_hands_back_each_staged_bucket_by_its_spool_place_and_forgets_them_at_the_next_push():
    from services.weightsync.nccl.staging import HostArena

    specs = [spec_of("a", torch.zeros(3, dtype=torch.float32)), spec_of("b", torch.zeros(2, 2, dtype=torch.bfloat16))]
    odd = [spec_of("c", torch.zeros(5, dtype=torch.uint8))]
    a, b, c = torch.arange(3.0), torch.ones(2, 2, dtype=torch.bfloat16), torch.arange(5, dtype=torch.uint8)
    arena = HostArena()
    arena.begin(HostArena.span(12 + 8 + 5, 3), pinned=False)
    arena.stage("p", 0, c.view(torch.uint8))  # an odd-sized bucket first: the next still starts aligned
    arena.stage("p", 4096, torch.cat([a.view(torch.uint8), b.view(-1).view(torch.uint8)]))
    arena.drain()
    ((name, got),) = arena.tensors("p", 0, odd)
    assert name == "c" and torch.equal(got, c)
    (na, ga), (nb, gb) = arena.tensors("p", 4096, specs)
    assert (na, nb) == ("a", "b") and torch.equal(ga, a) and torch.equal(gb, b)
    assert arena.tensors("p", 8192, specs) is None and arena.tensors("q", 0, odd) is None  # not staged here
    with pytest.raises(ValueError, match="specs take"):
        arena.tensors("p", 0, specs)
    with pytest.raises(ValueError, match="overflow"):
        arena.stage("p", 8192, torch.zeros(HostArena.span(25, 3), dtype=torch.uint8))
    arena.begin(64, pinned=False)  # the next push
    assert arena.tensors("p", 0, odd) is None
