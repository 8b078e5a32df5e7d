"""The `nccl` weight push against a real rollout server process (vLLM on CPU): the same vLLM
weight-transfer calls as on GPU (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`) with the `omrl_nccl` engine, the process group on gloo. Replies agree with the
version they are stamped with across a live update; malformed pushes (wrong shape, unknown name, a
corrupted or truncated bucket) are refused with nothing applied and the engine serving; a push whose
learner dies midway leaves the previous version served, and the next push lands. Each with the buckets
staged in a spool file and in the worker's host arena."""

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from services.common.grpc_server import free_port
from services.engines.base import SamplingSpec
from services.weightsync.buckets import TensorWeights
from services.weightsync.digest import bucket_digest
from services.weightsync.nccl.pack import DeviceBucket
from services.weightsync.nccl.send import NcclWeightPusher
from tests.support.rollout_server import perturbed, reference_logprobs, start_rollout


@pytest.fixture(scope="module", params=["file", "memory"])
def server(tmp_path_factory, request):
    """A server per staging (`rollout.weight_staging`): every test below runs against both. With `memory` the
    spool file stays empty (a load that read it would fail), so a push that lands was staged in the arena."""
    rollout = start_rollout(tmp_path_factory.mktemp("rollout"), [f"rollout.weight_staging={request.param}"])
    yield rollout
    rollout.kill()


@pytest.fixture(scope="module")
def hf(server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(server.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(server.model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "You are in cell 3."}], add_generation_prompt=True, tokenize=False
    )
    return model, tok(text, add_special_tokens=False)["input_ids"]


def _learner(server, cls=NcclWeightPusher):
    """A learner's pusher to `server`, its rendezvous store on a port of its own."""
    return cls(timeout_s=60, token=server.token, bucket_mb=1, host="127.0.0.1", port=free_port(), nccl_timeout_s=20)


@pytest.fixture(scope="module")
def pusher(server):
    p = _learner(server)
    yield p
    p.close()


def _status(server):
    s = server.call(lambda c: c.status())
    return s["policy_version"], s["weights_checksum"]


def _still_serves(server, prompt):
    out = server.call(lambda c: c.generate("probe", prompt, SamplingSpec(max_tokens=4, seed=1)))
    assert len(out.generation.token_ids) > 0


@pytest.fixture(scope="module", autouse=True)
def first_push(server, hf, pusher):
    """The learner's first push of v0, then the same set again, before any test of this server runs (each
    test reads the version it starts from): the statuses before, between and after, and both results."""
    model, _ = hf
    weights = TensorWeights.of(list(model.state_dict().items()))
    fresh = _status(server)
    (first,) = pusher.push(0, weights, [server.address], run=server.run)
    installed = _status(server)
    (again,) = pusher.push(0, weights, [server.address], run=server.run)
    return fresh, first, installed, again, _status(server)


def test_the_first_push_of_v0_installs_the_learners_set_and_the_same_set_again_is_a_success(first_push):
    """A fresh server holds the weights it loaded from disk (v0, no checksum). A learner's first push of v0
    installs its own set (the disk weights may not be the learner's); pushing that set again succeeds and
    changes nothing."""
    fresh, first, installed, again, after = first_push
    assert fresh == (0, "")
    assert first.ok and first.policy_version == 0, first.error
    assert first.checksum and first.checksum == first.sent_checksum
    assert installed == (0, first.checksum)
    assert again.ok and again.policy_version == 0 and again.checksum == first.checksum, again.error
    assert after == (0, first.checksum)


def test_every_reply_comes_wholly_from_one_policy_version(server, hf, pusher, first_push):
    """Requests in flight while an nccl push lands: each reply's logprobs match the weights of the version
    it is stamped with, never a mix; the served checksum is the one the learner sent. Starts from the first
    push's set, pushed again where a test before this one installed another."""
    model, prompt = hf
    disk = {name: t.clone() for name, t in model.state_dict().items()}
    v, checksum = _status(server)
    first = first_push[1]
    if checksum != first.checksum:
        (again,) = pusher.push(v + 1, TensorWeights.of(list(disk.items())), [server.address], run=server.run)
        assert again.ok and again.checksum == first.checksum, again.error
        v += 1
    versions = {v: disk, v + 1: dict(perturbed(model, 0.5, seed=3))}
    sampling = SamplingSpec(max_tokens=16, seed=None)
    weights = TensorWeights.of(list(versions[v + 1].items()))

    async def scenario(client):
        requests = [asyncio.create_task(client.generate(f"r{i}", prompt, sampling)) for i in range(24)]
        await asyncio.sleep(0.05)
        results = await asyncio.to_thread(pusher.push, v + 1, weights, [server.address], run=server.run)
        requests += [asyncio.create_task(client.generate(f"s{i}", prompt, sampling)) for i in range(8)]
        return results, await asyncio.gather(*requests)

    (result,), replies = server.call(scenario)
    assert result.ok, result.error
    assert result.policy_version == v + 1 and result.checksum == result.sent_checksum
    assert {r.policy_version for r in replies[-8:]} == {v + 1}
    assert {r.policy_version for r in replies} == {v, v + 1}, "the update landed while requests were in flight"
    try:
        for version, state in versions.items():
            model.load_state_dict(state)
            for reply in (r for r in replies if r.policy_version == version):
                ref = reference_logprobs(model, prompt, reply.generation.token_ids)
                assert torch.allclose(torch.tensor(reply.generation.logprobs), ref, atol=1e-3), f"v{version} reply"
    finally:
        model.load_state_dict(disk)  # `hf` is the other tests' disk model too
    assert _status(server) == (v + 1, result.checksum)


def _wrong(model, change):
    named = list(perturbed(model, 0.1, seed=11))
    name, t = named[1]
    named[1] = (name + ".extra", t) if change == "name" else (name, t[..., :-1].contiguous())
    return TensorWeights.of(named)


@pytest.mark.parametrize("change", ["shape", "name"])
def test_a_header_that_does_not_match_the_served_model_is_refused(server, hf, pusher, change):
    model, prompt = hf
    before = _status(server)
    (result,) = pusher.push(before[0] + 1, _wrong(model, change), [server.address], run=server.run)
    assert not result.ok and "nothing applied" in result.error
    assert _status(server) == before
    _still_serves(server, prompt)


class _Tampering(NcclWeightPusher):
    """Sends one bucket (the second) altered after its digest was computed (the digest of the intact bytes
    follows it), or declared one byte short."""

    how = "corrupt"

    def _buckets(self, weights):
        for i, bucket in enumerate(super()._buckets(weights)):
            if i == 1 and self.how == "corrupt":
                data = bucket.data.clone()
                data[len(data) // 2] ^= 0xFF
                bucket = DeviceBucket(bucket.specs, data, bucket_digest(bucket.data))
            elif i == 1 and self.how == "truncated":
                short = bucket.data[:-1]
                bucket = DeviceBucket(bucket.specs, short, bucket_digest(short))
            yield bucket


@pytest.mark.parametrize("how", ["corrupt", "truncated"])
def test_a_bad_bucket_is_refused_with_nothing_applied_and_the_next_push_lands(server, hf, how):
    model, prompt = hf
    before = _status(server)
    tampering = _learner(server, _Tampering)
    tampering.how = how
    try:
        weights = TensorWeights.of(list(perturbed(model, 0.1, seed=5)))
        (result,) = tampering.push(before[0] + 1, weights, [server.address], run=server.run)
        assert not result.ok and "nothing applied" in result.error, result
        assert _status(server) == before
        _still_serves(server, prompt)
        tampering.how = "none"
        (result,) = tampering.push(before[0] + 1, weights, [server.address], run=server.run)
        assert result.ok, result.error
        assert _status(server) == (before[0] + 1, result.sent_checksum)
    finally:
        tampering.close()


DYING_LEARNER = textwrap.dedent(
    """
    import os, sys
    import torch
    from services.weightsync.buckets import TensorWeights
    from services.weightsync.nccl.send import NcclWeightPusher
    from transformers import AutoModelForCausalLM

    address, token, run, port, version = sys.argv[1:6]
    model = AutoModelForCausalLM.from_pretrained(sys.argv[6], dtype=torch.float32)
    named = [(n, t + 0.3) for n, t in model.state_dict().items()]
    half = len(named) // 2

    def source():  # the learner dies while it gathers the second half of the set
        for i, pair in enumerate(named):
            if i == half:
                os._exit(3)
            yield pair

    weights = TensorWeights([w for w in TensorWeights.of(named).specs], source)
    pusher = NcclWeightPusher(token=token, bucket_mb=1, host="127.0.0.1", port=int(port), nccl_timeout_s=20)
    pusher.push(int(version), weights, [address], run=run)
    """
)


def test_a_push_whose_learner_dies_midway_leaves_the_previous_version_served(server, hf, pusher):
    model, prompt = hf
    before = _status(server)
    proc = subprocess.run(
        [sys.executable, "-c", DYING_LEARNER, server.address, server.token, server.run, str(free_port())]
        + [str(before[0] + 1), str(server.model)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr.decode()[-2000:]
    _still_serves(server, prompt)  # answered after the server dropped the broken push
    assert _status(server) == before
    weights = TensorWeights.of(list(perturbed(model, 0.2, seed=9)))
    (result,) = pusher.push(before[0] + 1, weights, [server.address], run=server.run)
    assert result.ok, result.error
    assert _status(server) == (before[0] + 1, result.sent_checksum)


def test_a_learner_whose_group_the_server_left_pushes_in_a_new_group(server, hf, pusher):
    """A server is in one learner's group at a time: another learner's push takes it into that one's. The
    first learner's next push finds the group it kept left (refused at once: a rank never joins a group
    twice) and lands in a new group, where it used to wait out the group's timeout and fail."""
    model, _ = hf
    v = _status(server)[0]
    sets = [TensorWeights.of(list(perturbed(model, 0.1, seed=21 + i))) for i in range(3)]
    (mine,) = pusher.push(v + 1, sets[0], [server.address], run=server.run)
    assert mine.ok, mine.error
    other = _learner(server)
    try:
        (theirs,) = other.push(v + 2, sets[1], [server.address], run=server.run)
        assert theirs.ok, theirs.error
    finally:
        other.close()
    (again,) = pusher.push(v + 3, sets[2], [server.address], run=server.run)
    assert again.ok, again.error
    assert _status(server) == (v + 3, again.sent_checksum)
