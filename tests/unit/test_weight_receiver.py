"""A bucketed push on the rollout side (fake engine, in-process and over gRPC): each bucket is checked as
it arrives, nothing reaches the engine unless the whole set verified, and a refused or interrupted push
leaves the served version, an empty spool folder, and a server that takes the next push."""

import asyncio
import dataclasses

import grpc
import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.rollout.client import GrpcRolloutClient, InProcessRolloutClient
from services.rollout.core import PushHeader
from services.weightsync.buckets import Bucket, TensorWeights, hash_specs, sha256_of
from services.weightsync.credential import auth_metadata
from services.weightsync.wire import SET_SHA256, SetHasher, WeightSetRejected
from tests.support.weight_push import make_core, named, serving


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


class Edited:
    """A weight set whose buckets pass through `edit(index, bucket) -> bucket` on the way out."""

    def __init__(self, value, edit):
        self.inner, self.edit = TensorWeights.of(named(value)), edit
        self.specs, self.checksum = self.inner.specs, ""

    def buckets(self, bucket_bytes):
        for i, bucket in enumerate(self.inner.buckets(bucket_bytes)):
            yield self.edit(i, bucket)
        self.checksum = self.inner.checksum


def resealed(bucket, data):
    return Bucket(bucket.specs, memoryview(bytes(data)), sha256_of(data))


def wrong_shape(i, b):
    return dataclasses.replace(b, specs=(dataclasses.replace(b.specs[0], shape=(3, 4)),) + b.specs[1:])


def unknown_name(i, b):
    return dataclasses.replace(b, specs=(dataclasses.replace(b.specs[0], name="x"),) + b.specs[1:])


@dataclasses.dataclass
class Declared:
    """A bucket that declares `nbytes` whatever its data holds."""

    specs: tuple
    data: memoryview
    sha256: str
    nbytes: int
    digest: str = ""

    @property
    def check(self) -> str:
        return self.digest or self.sha256


def truncated(i, b):
    return Declared(b.specs, b.data[:-4], b.sha256, b.nbytes, b.digest) if i == 1 else b


def bad_sha(i, b):  # a bucket from an older sender: the sha256 of its bytes, here wrong
    return Bucket(b.specs, b.data, "0" * 64) if i == 1 else b


def bad_digest(i, b):
    return dataclasses.replace(b, digest=SET_SHA256 + "0" * 64) if i == 1 else b


def nan_data(b):
    data = bytearray(b.data)
    data[:4] = torch.tensor([float("nan")]).view(torch.uint8).numpy().tobytes()
    return data


def nan(i, b):  # resealed with its own sha256
    return resealed(b, nan_data(b)) if i == 1 else b


def nan_chained(i, b):  # the set-sha256 digests recomputed over the edited bytes (see `Edited`)
    return dataclasses.replace(b, data=memoryview(nan_data(b))) if i == 1 else b


def flipped_data(b):
    data = bytearray(b.data)
    data[0] ^= 1
    return data


def flipped(i, b):  # bucket sha resealed, so only the set checksum can tell
    return resealed(b, flipped_data(b)) if i == 1 else b


def flipped_chained(i, b):  # its set-sha256 digest kept: the bucket's own check tells
    return dataclasses.replace(b, data=memoryview(flipped_data(b))) if i == 1 else b


class Rechained(Edited):
    """`Edited`, with every bucket's `set-sha256:` digest recomputed over the edited bytes (a sender
    whose bytes were bad before it hashed them)."""

    def buckets(self, bucket_bytes):
        hasher = SetHasher()
        for bucket in super().buckets(bucket_bytes):
            hash_specs(hasher, bucket.specs, bucket.data)
            yield dataclasses.replace(bucket, digest=hasher.running())


@pytest.mark.parametrize(
    "edit, match",
    [
        (wrong_shape, "header's next tensor"),
        (unknown_name, "header's next tensor"),
        (truncated, "bytes received"),
        (bad_sha, "sha256 does not match"),
        (bad_digest, "set-sha256 digest"),
        (nan, "NaN or Inf"),
        (nan_chained, "NaN or Inf"),
        (flipped, "checksum"),
        (flipped_chained, "set-sha256 digest"),
    ],
)
def test_a_malformed_bucket_is_refused_and_nothing_is_applied(tmp_path, edit, match):
    core, engine = make_core(tmp_path)
    client = InProcessRolloutClient(core)
    run(client.update_weights(1, TensorWeights.of(named(1.0)), bucket_bytes=64))
    edited = (Rechained if edit is nan_chained else Edited)(2.0, edit)
    with pytest.raises(InvalidArgument, match=match):
        run(client.update_weights(2, edited, bucket_bytes=64))
    assert (core.policy_version, len(engine.loads)) == (1, 1)
    assert list(tmp_path.iterdir()) == []
    run(client.update_weights(2, TensorWeights.of(named(2.0)), bucket_bytes=64))
    assert core.policy_version == 2 and torch.equal(engine.loads[-1]["big"], torch.full((64,), 2.0))


def test_a_whole_set_is_applied_with_the_set_checksum_and_its_spool_removed(tmp_path):
    core, engine = make_core(tmp_path)
    weights = TensorWeights.of(named(3.0))
    result = run(InProcessRolloutClient(core).update_weights(5, weights, bucket_bytes=64))
    assert (result.policy_version, result.checksum, core.weights_checksum) == (5, weights.checksum, weights.checksum)
    assert {n: t.tolist() for n, t in engine.loads[0].items()} == {n: t.tolist() for n, t in named(3.0)}
    assert list(tmp_path.iterdir()) == []
    again = run(InProcessRolloutClient(core).update_weights(5, weights, bucket_bytes=64))
    assert again.apply_seconds == 0.0 and len(engine.loads) == 1  # the checksum is known now: a no-op


def header(specs, bucket_bytes=64, total=None):
    return PushHeader(
        1, specs, "", bucket_bytes=bucket_bytes, total_bytes=sum(s.nbytes for s in specs) if total is None else total
    )


def test_headers_that_would_let_a_push_hold_more_memory_are_refused(tmp_path):
    core, _ = make_core(tmp_path)
    specs = TensorWeights.of(named(1.0)).specs
    with pytest.raises(InvalidArgument, match="bucket size"):
        core.begin_push(header(specs, bucket_bytes=0))
    with pytest.raises(InvalidArgument, match="header declares"):
        core.begin_push(header(specs, total=10**12))
    receiver = core.begin_push(header(specs, bucket_bytes=16))
    with pytest.raises(InvalidArgument, match="exceeds the header's bucket size"):
        run(core.receive(header(specs), receiver, receiver.start_bucket, specs[:2], 60, "0" * 64))
    receiver = core.begin_push(header(specs))
    run(core.receive(header(specs), receiver, receiver.start_bucket, specs[:1], 48, "0" * 64))
    with pytest.raises(InvalidArgument, match="more data than the 48 bytes"):
        run(core.receive(header(specs), receiver, receiver.add_data, b"\0" * 49))
    assert list(tmp_path.iterdir()) == []


def grpc_server(core):
    return serving(core, "tok")


def test_a_push_interrupted_midway_leaves_the_previous_version_served(tmp_path):
    core, engine = make_core(tmp_path)
    first = TensorWeights.of(named(1.0))

    async def scenario():
        async with grpc_server(core) as address:
            client = GrpcRolloutClient(address, weight_token="tok")
            await client.update_weights(1, first, bucket_bytes=64)
            specs = first.specs
            (bucket, *_) = TensorWeights.of(named(2.0)).buckets(64)
            sent = asyncio.Event()

            async def messages():
                yield rollout_pb2.WeightChunk(
                    header=rollout_pb2.WeightUpdateHeader(
                        version=2,
                        total_bytes=sum(s.nbytes for s in specs),
                        bucket_bytes=64,
                        tensors=[
                            rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes)
                            for s in specs
                        ],
                    )
                )
                yield rollout_pb2.WeightChunk(
                    bucket=rollout_pb2.WeightBucket(
                        tensors=[
                            rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes)
                            for s in bucket.specs
                        ],
                        nbytes=bucket.nbytes,
                        digest=bucket.digest,
                    )
                )
                yield rollout_pb2.WeightChunk(data=bytes(bucket.data))
                sent.set()
                await asyncio.sleep(3600)  # the learner dies here

            async with grpc.aio.insecure_channel(address) as channel:
                stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                call = stub.UpdateWeights(messages(), timeout=30, metadata=auth_metadata("tok"))
                await sent.wait()
                await asyncio.sleep(0.3)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            for _ in range(50):  # the server notices the cancel
                if not list(tmp_path.iterdir()):
                    break
                await asyncio.sleep(0.1)
            status = await client.status()
            assert (status["policy_version"], status["weights_checksum"]) == (1, first.checksum)
            assert list(tmp_path.iterdir()) == []
            after = await client.update_weights(2, TensorWeights.of(named(2.0)), bucket_bytes=64)
            await client.close()
            return after

    assert run(scenario()).policy_version == 2
    assert len(engine.loads) == 2


def test_a_commit_with_another_checksum_applies_nothing(tmp_path):
    core, engine = make_core(tmp_path)

    async def scenario():
        async with grpc_server(core) as address:
            client = GrpcRolloutClient(address, weight_token="tok")
            weights = TensorWeights.of(named(1.0))

            async def buckets():
                for b in weights.buckets(64):
                    yield b

            with pytest.raises(InvalidArgument, match="checksum"):
                await client.push_buckets(1, weights.specs, buckets(), lambda: "f" * 64, bucket_bytes=64)
            await client.close()

    run(scenario())
    assert engine.loads == [] and core.policy_version == 0 and list(tmp_path.iterdir()) == []


def test_an_apply_that_fails_midway_stops_serving_rather_than_mix_versions(tmp_path):
    from services.common.errors import Unavailable
    from services.engines.base import SamplingSpec

    core, engine = make_core(tmp_path)

    async def broken(named_tensors):
        raise RuntimeError("worker failed while loading")

    engine.load_weights = broken
    with pytest.raises(RuntimeError, match="worker failed"):
        run(InProcessRolloutClient(core).update_weights(1, TensorWeights.of(named(1.0)), bucket_bytes=64))
    assert not core.serving and core.policy_version == 0 and list(tmp_path.iterdir()) == []
    with pytest.raises(Unavailable, match="half-applied"):
        run(core.generate("r", [1], SamplingSpec(max_tokens=2)))


MIXED = [  # empty tensors at a bucket's start, middle and end; sizes that are not multiples of a chunk
    ("e0", torch.zeros(0)),
    ("a", torch.arange(7, dtype=torch.float32)),
    ("e1", torch.zeros(0, 3)),
    ("h", torch.arange(5, dtype=torch.float16)),
    ("e2", torch.zeros(0)),
    ("big", torch.arange(33, dtype=torch.float32)),
    ("e3", torch.zeros(0)),
]


@pytest.mark.parametrize("chunk", [1, 3, 10, 1000])
@pytest.mark.parametrize("sha256", [False, True])
def test_a_bucket_arriving_in_pieces_is_hashed_and_spooled_as_a_whole(tmp_path, chunk, sha256):
    """The worker feeds the set checksum piece by piece: tensor boundaries, empty tensors and pieces that
    cut a tensor anywhere give the digest and checksum of the whole set, and the spool holds its bytes."""
    from services.weightsync.grpc.receive import BucketReceiver

    weights = TensorWeights.of(MIXED)
    buckets = list(weights.buckets(40))
    assert len(buckets) > 2 and any(len(b.specs) > 2 for b in buckets)
    receiver = BucketReceiver(weights.specs, 40, sum(s.nbytes for s in weights.specs), str(tmp_path))
    for b in buckets:
        receiver.start_bucket(b.specs, b.nbytes, sha256_of(b.data) if sha256 else b.digest)
        for start in range(0, b.nbytes, chunk):
            receiver.add_data(bytes(b.data[start : start + chunk]))
    spool = receiver.commit(weights.checksum)
    back = list(spool.named_tensors())
    assert [n for n, _ in back] == [n for n, _ in MIXED]
    assert all(torch.equal(r, t) and r.dtype == t.dtype for (_, r), (_, t) in zip(back, MIXED, strict=True))
    spool.delete()
    receiver.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_bucket_whose_piece_differs_is_refused_before_the_next_bucket(tmp_path):
    from services.weightsync.grpc.receive import BucketReceiver

    weights = TensorWeights.of(MIXED)
    first, second, *_ = weights.buckets(40)
    receiver = BucketReceiver(weights.specs, 40, sum(s.nbytes for s in weights.specs), str(tmp_path))
    receiver.start_bucket(first.specs, first.nbytes, first.digest)
    data = bytearray(first.data)
    data[-1] ^= 1
    receiver.add_data(bytes(data[:5]))
    receiver.add_data(bytes(data[5:]))
    with pytest.raises(WeightSetRejected, match="set-sha256 digest"):
        receiver.start_bucket(second.specs, second.nbytes, second.digest)
    receiver.abort()
    other = BucketReceiver(weights.specs, 40, sum(s.nbytes for s in weights.specs), str(tmp_path))
    with pytest.raises(WeightSetRejected, match="neither"):  # the process-group form is not taken here
        other.start_bucket(first.specs, first.nbytes, "sha256:" + first.digest.split(":")[1])
    other.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, (4 << 20) + 3])
def test_a_data_chunk_encoded_by_hand_is_the_message_protobuf_would_send(size):
    from services.weightsync.grpc.send import encoded_data_chunk

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    encoded = encoded_data_chunk(memoryview(data))
    assert encoded == rollout_pb2.WeightChunk(data=data).SerializeToString()
    parsed = rollout_pb2.WeightChunk.FromString(encoded)
    assert parsed.WhichOneof("payload") == "data" and parsed.data == data


def test_a_receiver_used_after_its_abort_refuses_rather_than_waits(tmp_path):
    from services.weightsync.grpc.receive import BucketReceiver

    weights = TensorWeights.of(MIXED)
    first, second, *_ = weights.buckets(40)
    receiver = BucketReceiver(weights.specs, 40, sum(s.nbytes for s in weights.specs), str(tmp_path))
    receiver.start_bucket(first.specs, first.nbytes, first.digest)
    receiver.add_data(bytes(first.data)[:3])
    receiver.abort()
    receiver.start_bucket(second.specs, second.nbytes, second.digest)
    receiver.add_data(bytes(second.data))
    with pytest.raises(WeightSetRejected, match="already ended"):
        receiver.commit(weights.checksum)
    assert list(tmp_path.iterdir()) == []
