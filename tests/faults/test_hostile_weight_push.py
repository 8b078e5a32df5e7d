"""Hostile and mistaken weight pushes against a real rollout server (vLLM on CPU, tiny model): each is
refused with nothing applied, and the engine goes on serving the weights it had, bit for bit."""

import asyncio
import os
import signal
import warnings

import grpc
import pytest
import torch

from services.common.errors import FailedPrecondition, InvalidArgument, Unauthenticated
from services.common.protos import rollout_pb2, rollout_pb2_grpc
from services.engines.base import SamplingSpec
from services.weightsync.buckets import pack
from services.weightsync.credential import auth_metadata
from tests.support.rollout_server import SharedRollout

pytestmark = pytest.mark.faults

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    holder = SharedRollout(tmp_path_factory.mktemp("hostile"))
    yield holder
    holder.close(grace_s=60)


@pytest.fixture(scope="module")
def state(shared):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(shared.model, dtype=torch.float32).state_dict()


@pytest.fixture
def server(shared, state):
    """The module's server, started again if the dead-engine test ended it; each test reads the version it
    starts from."""
    rollout = shared.get()
    rollout.state = state
    return rollout


def served(server):
    """(version, checksum) and a seeded generation: equal before and after means the same weights."""
    status = server.call(lambda c: c.status())
    out = server.call(lambda c: c.generate("probe", PROMPT, SamplingSpec(max_tokens=6, seed=3)))
    return status["policy_version"], status["weights_checksum"], out.policy_version, out.generation


def assert_unchanged(server, before):
    after = served(server)
    assert after[:3] == before[:3]
    assert after[3].token_ids == before[3].token_ids
    assert torch.allclose(torch.tensor(after[3].logprobs), torch.tensor(before[3].logprobs), atol=1e-5)


def valid(server, scale=0.05, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(n, t + scale * torch.randn(t.shape, generator=g)) for n, t in server.state.items()]


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_a_push_without_the_token_is_refused(server, token):
    before = served(server)
    with pytest.raises(Unauthenticated):
        server.call(lambda c: c.update_weights(before[0] + 1, pack(valid(server))), token=token)
    assert_unchanged(server, before)


def _wrong_shape(ts):
    name, t = ts[0]
    return [(name, t[:-1]), *ts[1:]]


@pytest.mark.parametrize(
    "edit, match",
    [
        (_wrong_shape, "shape"),
        (lambda ts: ts + [("model.layers.7.mlp.extra.weight", torch.zeros(4))], "is not a parameter"),
        (lambda ts: ts[: len(ts) // 2], "incomplete weight set"),
        (lambda ts: [], "empty weight set"),
        (lambda ts: [(n, t.clone().fill_(float("nan")) if i == 1 else t) for i, (n, t) in enumerate(ts)], "NaN"),
    ],
    ids=["wrong-shape", "unknown-name", "partial", "empty", "nan"],
)
def test_a_set_that_does_not_fit_the_model_is_refused(server, edit, match):
    before = served(server)
    with pytest.raises(InvalidArgument, match=match):
        server.call(lambda c: c.update_weights(before[0] + 1, pack(edit(valid(server)))))
    assert_unchanged(server, before)


async def _raw_push(server, header, data_chunks, bucket=None):
    """Pushes `header` (and `bucket`) then the chunks, counting how many the server pulled before it answered."""
    pulled = [0]

    async def stream():
        yield rollout_pb2.WeightChunk(header=header)
        if bucket is not None:
            yield rollout_pb2.WeightChunk(bucket=bucket)
        for chunk in data_chunks:
            pulled[0] += 1
            yield rollout_pb2.WeightChunk(data=chunk)

    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.UpdateWeights(stream(), timeout=60, metadata=auth_metadata(server.token))
    return err.value, pulled[0]


def assert_refused(server, err, reason):
    """The server's status, or, when it cut off a stream the client was still sending, the INTERNAL that
    grpcio's asyncio client reports instead (grpc/grpc#36066); the server's log names the reason."""
    if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        assert reason in err.details()
    else:
        assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, "Internal error from Core")
    assert reason in server.log.read_text()


def _endless(chunk=b"\0" * (1 << 20)):
    while True:
        yield chunk


def _specs(specs):
    return [rollout_pb2.TensorSpec(name=s.name, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes) for s in specs]


def _header(version, specs, checksum="0" * 64):
    return rollout_pb2.WeightUpdateHeader(
        version=version,
        checksum=checksum,
        tensors=_specs(specs),
        total_bytes=sum(s.nbytes for s in specs),
        bucket_bytes=1 << 20,
    )


def test_an_over_size_declaration_is_refused_before_any_data_is_read(server):
    before = served(server)
    specs = list(pack(valid(server)).specs)
    huge = specs[0].__class__(specs[0].name, specs[0].dtype, (1 << 20, 1 << 12), 1 << 34)
    err, pulled = asyncio.run(_raw_push(server, _header(before[0] + 1, [huge, *specs[1:]]), _endless()))
    assert_refused(server, err, f"tensor {huge.name!r}: shape [1048576, 4096]")
    model_chunks = sum(s.nbytes for s in specs) // (1 << 20) + 1
    assert pulled < model_chunks + 64, "the server read past one model's size"
    assert_unchanged(server, before)


def test_a_bucket_longer_than_declared_is_cut_off(server):
    before = served(server)
    packed = pack(valid(server))
    first = next(packed.buckets(1 << 20))
    bucket = rollout_pb2.WeightBucket(tensors=_specs(first.specs), nbytes=first.nbytes, sha256=first.sha256)
    header = _header(before[0] + 1, packed.specs, packed.checksum)
    err, pulled = asyncio.run(_raw_push(server, header, _endless(), bucket=bucket))
    assert_refused(server, err, f"more data than the {first.nbytes} bytes its bucket declared")
    assert pulled < 64
    assert_unchanged(server, before)


def test_versions_never_go_back_without_a_flagged_rollback_of_the_same_run(server):
    version = served(server)[0]
    newer, older = pack(valid(server, seed=1)), pack(valid(server, seed=2))
    assert server.call(lambda c: c.update_weights(version + 2, newer)).policy_version == version + 2
    assert server.call(lambda c: c.update_weights(version + 2, newer)).apply_seconds == 0.0  # same set: no-op
    before = served(server)
    with pytest.raises(FailedPrecondition, match="not above the served"):
        server.call(lambda c: c.update_weights(version + 1, older))
    with pytest.raises(FailedPrecondition, match="not above the served"):
        server.call(lambda c: c.update_weights(version + 2, older))
    with pytest.raises(FailedPrecondition, match="for run 'another-run'"):
        server.call(lambda c: c.update_weights(version + 1, older, rollback=True, run="another-run"))
    assert_unchanged(server, before)
    reply = server.call(lambda c: c.update_weights(version + 1, older, rollback=True, run=server.run))
    assert reply.policy_version == version + 1 and reply.checksum == older.checksum
    assert served(server)[:3] == (version + 1, older.checksum, version + 1)


def test_the_learner_pusher_carries_the_token_from_its_environment(server, monkeypatch):
    from services.weightsync.grpc.send import GrpcWeightPusher

    version = served(server)[0]
    weights = pack(valid(server, seed=5))
    monkeypatch.setenv("OMRL_WEIGHT_TOKEN", "not-the-run-token")
    (refused,) = GrpcWeightPusher(timeout_s=60).push(version + 1, weights, [server.address])
    assert not refused.ok and "missing or wrong token" in refused.error
    monkeypatch.setenv("OMRL_WEIGHT_TOKEN", server.token)
    (applied,) = GrpcWeightPusher(timeout_s=60).push(version + 1, weights, [server.address])
    assert applied.ok and (applied.policy_version, applied.checksum) == (version + 1, weights.checksum)
    (again,) = GrpcWeightPusher(timeout_s=60).push(version + 1, weights, [server.address])  # a resumed learner
    assert again.ok and again.policy_version == version + 1


def test_a_dead_engine_ends_the_server_with_a_non_zero_exit(server):
    """It ends the server (the next test starts another). The engine core is the server's child process."""
    import psutil

    children = psutil.Process(server.proc.pid).children(recursive=True)
    engine = [p for p in children if "EngineCore" in " ".join([p.name(), *p.cmdline()])]
    assert engine, [(p.pid, p.name()) for p in children]
    for proc in engine:
        os.kill(proc.pid, signal.SIGKILL)
    assert server.proc.wait(timeout=120) != 0
    log = server.log.read_text()
    assert "vLLM engine is dead" in log
    if "exiting 1 now. Thread stacks:" in log:  # the exit deadline ended a hung cleanup: report where it hung
        hung = log[log.index("still running after") :][:6000]
        warnings.warn(f"the rollout server's shutdown hung:\n{hung}", stacklevel=1)
