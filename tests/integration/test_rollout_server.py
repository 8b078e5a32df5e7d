"""The rollout server as a real process (vLLM engine on CPU) over gRPC: generation stamped with the
policy version, weight updates that are verified whole and applied atomically, status, shutdown."""

import asyncio
import os
import signal
from typing import ClassVar

import psutil
import pytest
import redis
import torch

from services.common.config import EnvConfig, RolloutConfig
from services.common.errors import InvalidArgument
from services.common.trajectory import check_invariants
from services.engines.base import SamplingSpec
from services.envs.base import StepResult, TextEnv
from services.envs.client import InProcessEnvClient
from services.envs.registry import ENVS
from services.envs.service import EnvService
from services.envs.tools import TOOLSETS, ToolOutput, Toolset, ToolSpec
from services.rollout.action_parsers import PARSERS
from services.rollout.prompting import ChatFormatter
from services.rollout.tool_loop import ToolCallingLoop
from services.rollout.tool_parsers import ParsedCall, ParsedReply, ToolCallParser
from services.weightsync.buckets import PackedWeights, TensorWeights, pack
from tests.support.rollout_server import WORKER_CPU, SharedRollout, perturbed, reference_logprobs


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    holder = SharedRollout(tmp_path_factory.mktemp("rollout"))
    yield holder
    holder.close()


@pytest.fixture
def server(shared):
    """The module's server, started again if the SIGTERM test ended it."""
    rollout = shared.get()
    return {
        "address": rollout.address,
        "proc": rollout.proc,
        "log": rollout.log,
        "call": rollout.call,
        "run": rollout.run,
    }


@pytest.fixture(scope="module")
def hf(shared):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(shared.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(shared.model)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "You are in cell 3."}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    return model, prompt


def test_generate_returns_tokens_logprobs_and_version(server, hf):
    _, prompt = hf
    served = server["call"](lambda c: c.status())["policy_version"]
    out = server["call"](lambda c: c.generate("a", prompt, SamplingSpec(max_tokens=8, seed=1)))
    assert len(out.generation.token_ids) == len(out.generation.logprobs) > 0
    assert out.policy_version == served and out.generation.finish_reason in {"stop", "length"}


def test_the_engine_core_and_worker_are_forked_from_the_server_and_the_worker_keeps_its_cpu(server):
    # spawned (vLLM's CPU default), each would import vLLM again: 11-16 s apiece on a 2-core machine
    assert "vLLM engine processes: fork (other threads here: " in server["log"].read_text()
    processes = psutil.Process(server["proc"].pid).children(recursive=True)
    workers = [p for p in processes if p.name().startswith("VLLM::Worker")]
    assert [w.cpu_affinity() for w in workers] == [[WORKER_CPU]]  # as vLLM binds a spawned worker


def test_corrupted_update_is_rejected_and_nothing_changes(server, hf):
    model, _ = hf
    before = server["call"](lambda c: c.status())
    good = pack(perturbed(model, 0.1, seed=7))
    bad = PackedWeights(good.specs, good.checksum, good.payload[:-4] + b"\x00\x00\x00\x00")
    with pytest.raises(InvalidArgument, match="nothing applied"):
        server["call"](lambda c: c.update_weights(41, bad))
    after = server["call"](lambda c: c.status())
    assert (after["policy_version"], after["weights_checksum"]) == (
        before["policy_version"],
        before["weights_checksum"],
    )


class AlwaysCalls(ToolCallParser):
    """Reads every reply as a call of `add`: the random tiny model's turns then all end in tool results."""

    def parse(self, text):
        return ParsedReply([ParsedCall("add", '{"a": 1234, "b": 4321}')])

    def format_calls(self, calls):
        raise NotImplementedError


class Adder(Toolset):
    type = "test_adder"

    def specs(self):
        return [ToolSpec("add", "a+b", {"type": "object", "properties": {"a": {"type": "integer"}}})]

    async def call(self, name, arguments, ctx):
        return ToolOutput(str(arguments["a"] + arguments["b"]))


class Sum(TextEnv):
    tools: ClassVar[dict] = {"adder": {"type": "test_adder"}}
    runs_inline = True

    def reset(self, task_index, options):
        return "1234+4321?"

    def step(self, action):
        return StepResult("done", 0.0, True, False)


@pytest.fixture
def adder():
    TOOLSETS.register("test_adder")(Adder)
    ENVS.register("test_sum")(Sum)
    yield
    TOOLSETS.unregister("test_adder")
    ENVS.unregister("test_sum")


def test_tool_calling_episodes_agree_with_the_learners_model_on_every_model_token(server, hf, shared, adder):
    """The tool-calling loop on the real engine: sampled tokens stay exact across tool turns (the engine's logprobs
    equal the model's on the recorded sequence), tool results are in the record with the loss mask off."""
    from transformers import AutoTokenizer

    model, _ = hf
    tokenizer = AutoTokenizer.from_pretrained(shared.model)

    async def play(client):
        loop = ToolCallingLoop(
            client,
            InProcessEnvClient(EnvService()),
            ChatFormatter(tokenizer),
            PARSERS.create("xml_action"),
            RolloutConfig(group_size=3, max_new_tokens=12, agent_loop="tools"),
            EnvConfig(name="test_sum", max_turns=3),
            max_model_len=512,
            tool_parser=AlwaysCalls(),
        )
        return await loop.run_group(task_index=0, group_id="g", seed=5)

    group = server["call"](play)
    for traj in group:
        check_invariants(traj)
        assert [t.tool_calls for t in traj.turns] == [1, 1, 1] and traj.stop_reason == "max_turns"
        ids = torch.tensor([list(traj.token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        reference = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor(list(traj.loss_mask[1:]), dtype=torch.bool)
        served = torch.tensor(list(traj.logprobs[1:]))
        assert mask.sum() == sum(t.model_tokens for t in traj.turns) > 0
        assert torch.allclose(served[mask], reference[mask], atol=1e-3)
        for turn in traj.turns:
            after = turn.start + turn.model_tokens
            assert set(traj.loss_mask[after : after + turn.env_tokens]) == {0}
            assert "<tool_response> 5555</tool_response>" in tokenizer.decode(
                traj.token_ids[after : after + turn.env_tokens]
            )


def test_every_reply_comes_wholly_from_one_policy_version(server, hf):
    """Requests in flight while an update lands: each reply's logprobs match the weights of the
    version it is stamped with, never a mix. No other test here lands a push: until this one, the server
    serves the weights it loaded from disk."""
    model, prompt = hf
    v = server["call"](lambda c: c.status())["policy_version"]
    versions = {v: model.state_dict(), v + 1: dict(perturbed(model, 0.5, seed=3))}
    sampling = SamplingSpec(max_tokens=16, seed=None)

    async def scenario(client):
        requests = [asyncio.create_task(client.generate(f"r{i}", prompt, sampling)) for i in range(24)]
        await asyncio.sleep(0.05)
        # the learner's form: buckets built from tensors, each checked by its set-sha256 digest
        pushed = TensorWeights.of(list(versions[v + 1].items()))
        update = await client.update_weights(v + 1, pushed, bucket_bytes=1 << 18)
        requests += [asyncio.create_task(client.generate(f"s{i}", prompt, sampling)) for i in range(8)]
        return update, await asyncio.gather(*requests)

    update, replies = server["call"](scenario)
    assert update.policy_version == v + 1
    assert {r.policy_version for r in replies[-8:]} == {v + 1}
    assert {r.policy_version for r in replies} == {v, v + 1}, "the update landed while requests were in flight"
    for version, weights in versions.items():
        model.load_state_dict(weights)
        for reply in (r for r in replies if r.policy_version == version):
            ref = reference_logprobs(model, prompt, reply.generation.token_ids)
            assert torch.allclose(torch.tensor(reply.generation.logprobs), ref, atol=1e-3), f"v{version} reply"
    status = server["call"](lambda c: c.status())
    assert status["policy_version"] == v + 1 and status["weights_checksum"] == update.checksum


def test_sigterm_shuts_down_gracefully_and_leaves_the_rollout_registry(server):
    registry = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=5)
    key = f"omrl:{server['run']}:rollout_servers"
    assert registry.hexists(key, server["address"])  # the heartbeat registered it
    proc = server["proc"]
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, server["log"].read_text()[-2000:]
    assert not registry.exists(key)
