"""The learner's pusher: one pass over the weight source feeds every server's stream; a dead server
neither stops the others nor the pass (an FSDP source must be walked to its end by every rank)."""

import asyncio

import torch

from services.common.grpc_server import free_port
from services.weightsync.buckets import TensorWeights
from services.weightsync.grpc.send import GrpcWeightPusher
from tests.support.weight_push import make_core, named, serving


class CountingWeights(TensorWeights):
    def __init__(self, value):
        inner = TensorWeights.of(named(value))
        self.passes, self.tensors_read = 0, 0

        def source():
            self.passes += 1
            for item in inner.named_tensors():
                self.tensors_read += 1
                yield item

        super().__init__(inner.specs, source)


def test_one_pass_feeds_every_server_and_a_dead_one_stops_nothing(tmp_path):
    cores = [make_core(tmp_path / str(i)) for i in range(2)]
    weights = CountingWeights(4.0)
    pusher = GrpcWeightPusher(timeout_s=20, token="tok", bucket_mb=1)
    pusher.bucket_bytes = 64  # several buckets

    async def scenario():
        async with serving(cores[0][0], "tok") as a, serving(cores[1][0], "tok") as b:
            dead = f"127.0.0.1:{free_port()}"
            return await asyncio.to_thread(pusher.push, 3, weights, [a, dead, b])

    results = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [r.ok for r in results] == [True, False, True]
    assert weights.passes == 1 and weights.tensors_read == len(weights.specs)
    assert {r.checksum for r in results if r.ok} == {weights.checksum} != {""}
    for core, engine in cores:
        assert core.policy_version == 3 and torch.equal(engine.loads[0]["big"], torch.full((64,), 4.0))


def test_the_source_is_walked_to_its_end_when_every_push_fails(tmp_path):
    weights = CountingWeights(1.0)
    pusher = GrpcWeightPusher(timeout_s=5, token="tok")
    pusher.bucket_bytes = 64
    results = pusher.push(1, weights, [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    assert [r.ok for r in results] == [False, False]
    assert weights.tensors_read == len(weights.specs) and weights.checksum
