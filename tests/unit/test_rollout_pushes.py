"""The rollout core's push rules and start-up gating on a fake engine, over an in-process gRPC server:
versions never go back (bar a flagged rollback of the same run), re-pushing the served set is a no-op,
pushes need the token, and a server that must wait for the run's version serves nothing meanwhile."""

import asyncio

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import FailedPrecondition, InvalidArgument, Unauthenticated, Unavailable
from services.engines.base import SamplingSpec
from services.rollout.client import GrpcRolloutClient, InProcessRolloutClient
from services.rollout.core import RolloutCore
from services.weightsync.buckets import pack
from services.weightsync.credential import PushAuthenticator
from services.weightsync.wire import ModelSignature
from tests.support.weight_push import FakeEngine, serving


def weights(value: float):
    return pack([("w", torch.full((2, 3), value)), ("b", torch.full((3,), value))])


def make_core(**kw) -> tuple[RolloutCore, FakeEngine]:
    engine = FakeEngine()
    signature = ModelSignature.of([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    return RolloutCore(engine, "fake", signature=signature, run="run-a", **kw), engine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_versions_move_forward_only_and_the_served_set_can_be_pushed_again():
    core, engine = make_core()
    client = InProcessRolloutClient(core)

    async def scenario():
        await client.update_weights(0, weights(0.5))  # the learner's first push of v0 replaces the disk weights
        await client.update_weights(2, weights(2.0))
        again = await client.update_weights(2, weights(2.0))
        with pytest.raises(FailedPrecondition, match="version 1 is not above the served v2"):
            await client.update_weights(1, weights(1.0))
        with pytest.raises(FailedPrecondition, match="version 2 is not above"):
            await client.update_weights(2, weights(9.0))
        return again

    again = run(scenario())
    assert again.policy_version == 2 and again.apply_seconds == 0.0
    assert len(engine.loads) == 2 and (core.policy_version, core.weights_checksum) == (2, weights(2.0).checksum)


def test_a_rollback_needs_the_flag_and_the_same_run():
    core, engine = make_core()
    client = InProcessRolloutClient(core)

    async def scenario():
        await client.update_weights(5, weights(5.0))
        with pytest.raises(FailedPrecondition, match="for run 'run-b'"):
            await client.update_weights(3, weights(3.0), rollback=True, run="run-b")
        return await client.update_weights(3, weights(3.0), rollback=True, run="run-a")

    assert run(scenario()).policy_version == 3
    assert core.policy_version == 3 and float(engine.loads[-1]["w"][0, 0]) == 3.0


def test_an_invalid_set_reaches_no_engine():
    core, engine = make_core()
    client = InProcessRolloutClient(core)
    nan = pack([("w", torch.full((2, 3), float("nan"))), ("b", torch.zeros(3))])
    with pytest.raises(InvalidArgument, match="'w' holds NaN"):
        run(client.update_weights(1, nan))
    with pytest.raises(InvalidArgument, match="incomplete weight set"):
        run(client.update_weights(1, pack([("w", torch.zeros(2, 3))])))
    assert engine.loads == [] and core.policy_version == 0


async def health(address):
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def wait_health(address, want):
    while (status := await health(address)) != want:
        await asyncio.sleep(0.05)
    return status


def test_pushes_without_the_token_are_refused_and_change_nothing():
    core, engine = make_core()

    async def scenario():
        async with serving(core, "s3cret") as address:
            for token in (None, "wrong", "s3cret-but-longer"):
                client = GrpcRolloutClient(address, weight_token=token)
                with pytest.raises(Unauthenticated, match="missing or wrong token"):
                    await client.update_weights(1, weights(1.0))
                await client.close()
            client = GrpcRolloutClient(address, weight_token="s3cret")
            reply = await client.update_weights(1, weights(1.0))
            await client.close()
            return reply

    assert run(scenario()).policy_version == 1
    assert len(engine.loads) == 1


def test_a_server_behind_the_run_serves_nothing_until_it_holds_that_version():
    core, engine = make_core(required_version=4)
    sampling = SamplingSpec(max_tokens=2)

    async def scenario():
        async with serving(core, "t") as address:
            client = GrpcRolloutClient(address, weight_token="t")
            assert await health(address) == "NOT_SERVING"
            assert (await client.status())["waiting_for_version"] == 4
            with pytest.raises(Unavailable, match="waiting for weights v4"):
                await client.generate("r", [1, 2], sampling)
            await client.update_weights(3, weights(3.0))
            assert await health(address) == "NOT_SERVING" and core.waiting_for_version == 4
            await client.update_weights(4, weights(4.0))
            await wait_health(address, "SERVING")
            out = await client.generate("r", [1, 2], sampling)
            await client.close()
            return out

    assert run(scenario()).policy_version == 4
    assert core.waiting_for_version == 0


def test_a_dead_engine_turns_health_not_serving():
    core, _ = make_core()

    async def scenario():
        async with serving(core, "t") as address:
            assert await health(address) == "SERVING"
            core.engine_dead = True
            return await wait_health(address, "NOT_SERVING")

    assert run(scenario()) == "NOT_SERVING"


def test_token_less_server_starts_only_on_loopback():
    assert PushAuthenticator.for_server("127.0.0.1", None) is not None
    assert PushAuthenticator.for_server("::1", None) is not None
    with pytest.raises(SystemExit, match="OMRL_WEIGHT_TOKEN is not set"):
        PushAuthenticator.for_server("0.0.0.0", None)
    PushAuthenticator.for_server("0.0.0.0", "t")


def test_a_push_wakes_workers_waiting_for_a_new_version_at_once():
    core, _ = make_core()
    client = InProcessRolloutClient(core)

    async def scenario():
        await client.update_weights(0, weights(0.5))
        waiting = asyncio.create_task(core.wait_for_new_version(0, timeout_s=20))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        loop = asyncio.get_running_loop()
        pushed_at = loop.time()
        await client.update_weights(1, weights(1.0))
        await waiting
        assert loop.time() - pushed_at < 1.0  # woken by the push, not by the 20 s timeout
        started = loop.time()
        await core.wait_for_new_version(1, timeout_s=0.1)  # no push: returns after the timeout
        assert loop.time() - started >= 0.09
        await core.wait_for_new_version(0, timeout_s=20)  # already past the version seen: at once
        assert not core._version_waiters

    run(scenario())


def test_a_first_push_whose_checksum_comes_at_the_commit_is_not_taken_for_the_served_set():
    from services.rollout.core import PushHeader

    core, _ = make_core()
    specs = [s for s in weights(0.5).specs]
    assert (core.policy_version, core.weights_checksum) == (0, "")
    assert core.admit(PushHeader(0, specs, checksum="")) is False  # the disk weights are not the learner's v0
    assert core.admit(PushHeader(0, specs, checksum=weights(0.5).checksum)) is False


class BrokenGroupEngine(FakeEngine):
    """Joins the process group, then finds it broken when the push ends (a learner that died midway)."""

    async def begin_nccl_push(self, rendezvous, **sizes):
        pass

    async def end_nccl_push(self, ok):
        raise RuntimeError("the process group is broken")


def _nccl_push_core(engine, tmp_path):
    """A rollout core serving the two-tensor model of `weights`, and the header of an nccl push of it."""
    from services.rollout.core import PushHeader

    signature = ModelSignature.of([("w", torch.zeros(2, 3)), ("b", torch.zeros(3))])
    core = RolloutCore(engine, "fake", signature=signature, run="run-a", spool_dir=str(tmp_path))
    return core, PushHeader(1, list(weights(1.0).specs), checksum="", bucket_bytes=1 << 20)


def test_a_broken_group_at_the_end_of_an_nccl_push_deletes_the_spool_and_frees_the_push_slot(tmp_path):
    engine = BrokenGroupEngine()
    core, header = _nccl_push_core(engine, tmp_path)

    async def scenario():
        for checksum in (None, "0" * 64):  # the stream broke / the commit came
            staging = await core.begin_nccl_push(header, {})
            assert list(tmp_path.iterdir())
            with pytest.raises(RuntimeError, match="broken"):
                await core.end_nccl_push(header, staging, checksum)
            assert not list(tmp_path.iterdir())
            assert not core._nccl_lock.locked()

    run(scenario())
    assert (core.policy_version, engine.loads) == (0, [])


class LastBucketBadEngine(FakeEngine):
    """Pipelined receives: the last bucket's checks run at the flush, and fail there."""

    def __init__(self):
        super().__init__()
        self.calls = []

    async def begin_nccl_push(self, rendezvous, **sizes):
        self.calls.append("begin")

    async def flush_nccl_bucket(self, digest=""):
        self.calls.append("flush")
        raise RuntimeError("bucket of 'b': its bytes do not match the digest")

    async def end_nccl_push(self, ok):
        self.calls.append(f"end ok={ok}")


def test_a_last_bucket_that_fails_at_the_flush_is_refused_before_the_commit_with_nothing_applied(tmp_path):
    engine = LastBucketBadEngine()
    core, header = _nccl_push_core(engine, tmp_path)

    async def scenario():
        staging = await core.begin_nccl_push(header, {})
        with pytest.raises(InvalidArgument, match="nothing applied: the last bucket was not received: bucket of 'b'"):
            await core.end_nccl_push(header, staging, "0" * 64)
        assert not list(tmp_path.iterdir()) and not core._nccl_lock.locked()

    run(scenario())
    assert engine.calls == ["begin", "flush", "end ok=False"]
    assert (core.policy_version, engine.loads) == (0, [])
