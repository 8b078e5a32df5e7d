"""The vLLM backend on a real engine (CPU): token ids and logprobs, stop handling, and in-place weight
loads checked against a float32 transformers forward pass, for an untied and a tied output head.

One engine per model variant (module-scoped, parametrized): pytest runs every test of one variant,
shuts its engine down, then starts the next. Each engine keeps its own event loop, since vLLM's async
engine must be driven from the loop it was started in (pytest-asyncio is not used here).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from services.common.grpc_server import free_port  # noqa: E402
from services.common.tiny_model import build_tiny_model  # noqa: E402
from services.engines.base import BACKENDS, SamplingSpec  # noqa: E402
from services.weightsync.buckets import TensorWeights  # noqa: E402
from services.weightsync.spool import SpoolWriter  # noqa: E402
from tests.support.processes import vllm_children  # noqa: E402

ATOL = 1e-3
CORPUS = [
    f"You are in room {i} of a corridor. Exits: left, right. Reply with <action>left</action> "
    f"or <action>right</action>. I go <action>{'left' if i % 3 else 'right'}</action>."
    for i in range(40)
] + ["The quick brown fox jumps over the lazy dog while the agent looks for the goal."] * 4
ENGINE_SETTINGS = dict(
    dtype="float32",
    max_model_len=512,
    gpu_memory_utilization=0.05,
    max_num_seqs=64,
    enforce_eager=True,
    seed=0,
    engine_args={"max_num_batched_tokens": 4096, "prefix_caching_hash_algo": "sha256"},
)
"""Small KV cache (a share of RAM on CPU), short context, no compile warm-up: a fast start. The engine
args are passed through to vLLM (the defaults' values: the tests' results do not depend on them)."""


class Engine:
    """A started backend, the loop that drives it, and the transformers model it should match."""

    def __init__(self, model_dir: Path, tied: bool):
        self.model_dir = model_dir
        self.tied = tied
        self.loop = asyncio.new_event_loop()
        self.backend = BACKENDS.create("vllm", str(model_dir), **ENGINE_SETTINGS)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.reference = self._load_reference()
        self.eos_id = self.tokenizer.eos_token_id
        self._ids = 0

    def _load_reference(self):
        model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        return model.eval()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def request_id(self) -> str:
        self._ids += 1
        return f"t{self._ids}"

    def prompt(self, text: str) -> list[int]:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )

    def generate_many(self, prompts: list[list[int]], spec: SamplingSpec):
        async def go():
            return await asyncio.gather(*(self.backend.generate(self.request_id(), p, spec) for p in prompts))

        return self.run(go())

    def load(self, model) -> None:
        """Pushes `model`'s parameters (HF names; a tied head appears once, as the embedding) and
        makes it the reference."""
        self.run(self.backend.load_weights([(n, p.detach()) for n, p in model.named_parameters()]))
        self.reference = model


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], output: list[int]) -> list[float]:
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


EXPORT = """
import sys
from services.common.config import TrainConfig
from tests.support.smoke import synthetic_trajectories
from services.learner.trainer import PolicyTrainer
config = TrainConfig.model_validate({"learner": {"device": "cpu"}, "algorithm": {"lr": 1e-2}})
trainer = PolicyTrainer(config, sys.argv[1])
trainer.train_step(synthetic_trajectories(8, 4, seed=0))
trainer.export_hf(sys.argv[2])
"""


def learner_export(base: Path, out: Path) -> Path:
    """`base` after one learner step, as the learner exports a trained policy (its own process: the learner
    sets up torch.distributed)."""
    subprocess.run(
        [sys.executable, "-c", EXPORT, str(base), str(out)],
        check=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied-learner-export"])
def engine(request, tmp_path_factory):
    """The tied variant serves the learner's Hugging Face export of a trained tiny model, so every test here
    also checks that vLLM and transformers load an export alike."""
    tied = request.param
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp("tiny_tied" if tied else "tiny"), CORPUS, seed=1, tie_word_embeddings=tied
    )
    if tied:
        model_dir = learner_export(model_dir, tmp_path_factory.mktemp("export") / "policy_hf")
    eng = Engine(model_dir, tied)
    eng.run(eng.backend.start())
    try:
        yield eng
    finally:
        eng.run(eng.backend.shutdown())
        eng.loop.close()
        from vllm import envs as vllm_envs

        assert not vllm_envs._is_envs_cache_enabled(), "an engine started next in this process must read VLLM_* afresh"
        psutil.wait_procs(vllm_children(), timeout=30)
        assert not vllm_children(), "vLLM processes left after shutdown"


def test_registered_and_described(engine):
    assert BACKENDS.get("vllm") is type(engine.backend)
    info = engine.backend.describe()
    assert info["backend"] == "vllm" and info["model"] == str(engine.model_dir) and info["dtype"] == "float32"
    assert info["engine_args"] == ENGINE_SETTINGS["engine_args"] and info["gpus"] == 1


def test_vllm_settings_are_cached_in_this_process_while_the_engine_runs(engine):
    """vLLM reads VLLM_* from os.environ at every use until its envs cache is on (per request, in input and
    output processing); its engine core and workers turn it on, and so does the backend once started."""
    from vllm import envs as vllm_envs

    assert vllm_envs._is_envs_cache_enabled()


def test_engine_args_reach_vllm(engine):
    config = engine.backend.engine.vllm_config
    assert config.scheduler_config.max_num_batched_tokens == 4096
    assert config.cache_config.prefix_caching_hash_algo == "sha256"
    assert config.parallel_config.tensor_parallel_size == 1
    assert config.observability_config is not None and engine.backend.engine.log_stats


ENGINE = "omrl_rollout_engine_"
VLLM_OWN = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


def scrape(port: int) -> dict[str, float]:
    """`name{state}` -> value on a metrics endpoint, scraped as plain text (vLLM's own labels summed over)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name + (f"{{{s.labels['state']}}}" if s.name == ENGINE + "requests" else "")
            out[name] = out.get(name, 0.0) + s.value
    return out


@contextlib.contextmanager
def metrics_endpoint():
    """prometheus_client's default registry served on a free loopback port, as the rollout serves it."""
    from prometheus_client import start_http_server

    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1")
    try:
        yield port
    finally:
        server.shutdown()
        thread.join(timeout=10)


def test_vllm_statistics_reach_the_metrics_endpoint(engine):
    """The metrics endpoint the rollout serves (prometheus_client's default registry, as
    services.common.grpc_server.serve starts it) carries the engine's statistics, fed from vLLM's:
    prefix-cache queries and hits, and, sampled while more requests than max_num_seqs run, the running
    and waiting requests and the KV cache in use. vLLM's own `vllm:*` series are there too.

    The running/waiting peak is made to happen whatever the machine's load and whatever weights earlier
    tests left: the requests are queued while the engine is paused (its first step takes max_num_seqs of
    them at once, the rest wait) and ignore the eos, so none ends, and none of the waiting starts, for
    96 engine steps."""
    with metrics_endpoint() as port:
        before = scrape(port)
        assert set(VLLM_OWN) <= set(before), sorted(set(VLLM_OWN) - set(before))
        # Twice the same prompt, longer than 128 tokens: the second finds the first's whole KV blocks
        prompt = engine.prompt(" ".join(CORPUS[6:11]))
        assert len(prompt) > 128
        for seed in (1, 2):
            engine.generate_many([prompt], SamplingSpec(max_tokens=4, seed=seed))
        after = scrape(port)
        for prefix in (ENGINE + "prefix_cache_", "vllm:prefix_cache_"):
            queried = after[prefix + "queries_total"] - before[prefix + "queries_total"]
            hits = after[prefix + "hits_total"] - before[prefix + "hits_total"]
            assert queried >= 2 * len(prompt) - 1, (prefix, queried, len(prompt))
            assert 128 <= hits < queried, (prefix, hits, queried)

        seqs = ENGINE_SETTINGS["max_num_seqs"]
        prompts = [engine.prompt(f"Room {i}. Which way?") for i in range(seqs + 16)]
        watched = (
            ENGINE + "requests{running}",
            ENGINE + "requests{waiting}",
            ENGINE + "kv_cache_usage",
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
        )

        kv = (ENGINE + "kv_cache_usage", "vllm:kv_cache_usage_perc")

        async def sample_under_load() -> tuple[dict[str, float], list[tuple[float, float]]]:
            batch = await _queued_while_paused(engine, prompts, _UNSTOPPABLE)
            peak, kv_pairs = dict.fromkeys(watched, 0.0), []
            while not batch.done():
                sample = await asyncio.to_thread(scrape, port)
                for name in watched:
                    peak[name] = max(peak[name], sample.get(name, 0.0))
                kv_pairs.append((sample.get(kv[0], 0.0), sample.get(kv[1], 0.0)))
                await asyncio.sleep(0.05)
            await batch
            return peak, kv_pairs

        peak, kv_pairs = engine.run(sample_under_load())
        assert peak[ENGINE + "requests{running}"] == peak["vllm:num_requests_running"] == seqs
        assert peak[ENGINE + "requests{waiting}"] == peak["vllm:num_requests_waiting"] == len(prompts) - seqs
        assert 0 < peak[kv[0]] <= 1 and 0 < peak[kv[1]] <= 1, peak
        # the two gauges are set by two loggers on each engine step and one scrape reads them a few ms apart, so a
        # sample may straddle a step (32-token KV blocks on CPU change the usage during decoding): they must agree
        # in the samples that do not, or, where every sample straddled one (a loaded machine took two), with the
        # engine paused
        if not any(0 < ours == theirs for ours, theirs in kv_pairs):
            settled = engine.run(_kv_gauges_paused(engine, port, kv))
            assert settled is not None and 0 < settled[0] == settled[1] <= 1, (kv_pairs, settled)
        idle = scrape(port)
        assert idle[ENGINE + "requests{running}"] == idle[ENGINE + "requests{waiting}"] == 0
        assert ENGINE + "preemptions_total" in idle  # none here: the KV cache is far larger than the batch


_UNSTOPPABLE = dict(max_tokens=96, seed=3, ignore_eos=True)
"""vLLM sampling for the load the running/waiting peak is sampled under: each request runs its 96 steps."""


async def _queued_while_paused(engine, prompts: list[list[int]], sampling: dict) -> asyncio.Future:
    """`prompts` sent to vLLM while its scheduler is paused (`keep`: requests are queued, no step runs), then
    resumed once the front end holds them all: its first step admits max_num_seqs at once and queues the rest,
    instead of stepping on the first while the event loop adds the others (on a loaded machine, for longer than
    a short request lasts). vLLM's own generate, for `ignore_eos`, which the backend does not offer."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    llm = engine.backend.engine
    params = SamplingParams(**sampling, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    async def one(prompt: list[int]) -> None:
        (engine_input,) = llm.renderer.render_cmpl([TokensPrompt(prompt_token_ids=prompt)])
        async for out in llm.generate(engine_input, params, engine.request_id()):
            assert out.outputs[0].finish_reason in (None, "length"), out

    await llm.pause_generation(mode="keep", clear_cache=False)
    try:
        batch = asyncio.gather(*(one(p) for p in prompts))
        while llm.output_processor.get_num_unfinished_requests() < len(prompts) and not batch.done():
            await asyncio.sleep(0.01)
    finally:
        await llm.resume_generation()
    return batch


async def _kv_gauges_paused(engine, port: int, kv: tuple[str, str]) -> tuple[float, float] | None:
    """Both KV-cache gauges read with the engine paused while requests hold KV blocks: requests kept
    (`pause_generation(mode="keep")`), the engine takes no step, so once two scrapes agree both gauges hold
    the last step's value. Long requests (200 tokens) so that a scrape sees them running before they end."""
    spec = SamplingSpec(max_tokens=200, seed=4)
    prompts = [engine.prompt(f"Hall {i}. Which way?") for i in range(8)]
    batch = asyncio.gather(*(engine.backend.generate(engine.request_id(), p, spec) for p in prompts))
    while not batch.done():
        now = await asyncio.to_thread(scrape, port)
        if now.get(kv[0], 0.0) > 0 and now.get(kv[1], 0.0) > 0:
            break
        await asyncio.sleep(0.01)
    await engine.backend.engine.pause_generation(mode="keep", clear_cache=False)
    settled, earlier = None, None
    try:
        for _ in range(200):
            now = await asyncio.to_thread(scrape, port)
            pair = (now.get(kv[0], 0.0), now.get(kv[1], 0.0))
            if pair == earlier:
                settled = pair
                break
            earlier = pair
            await asyncio.sleep(0.02)
    finally:
        await engine.backend.engine.resume_generation()
    await batch
    return settled


def perturbed(model, seed: int, scale: float = 0.02):
    """A copy of `model` with noise on every parameter (the embedding once when the head is tied)."""
    new = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    new.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return new


def test_a_groups_short_prompt_is_computed_once(engine):
    """GRPO sends a group's samples of one prompt at once. vLLM's prefix cache shares whole KV blocks only,
    and vLLM-CPU's default block (128 tokens) is longer than the built-in tasks' prompts, so the backend
    sets 32 on CPU: the 7 later samples of a 40-127-token prompt find its first block(s) cached."""
    prompt = engine.prompt(" ".join(CORPUS[2:4]))
    assert 40 <= len(prompt) < 128, len(prompt)
    with metrics_endpoint() as port:
        before = scrape(port)
        engine.generate_many([prompt] * 8, SamplingSpec(max_tokens=4, seed=7))
        after = scrape(port)
    hits = after[ENGINE + "prefix_cache_hits_total"] - before[ENGINE + "prefix_cache_hits_total"]
    assert hits >= 7 * 32 * ((len(prompt) - 1) // 32), (hits, len(prompt))


def test_load_weights_matches_new_model(engine):
    old = engine.reference
    # Longer than 128 tokens (several KV blocks) so the first call caches the prompt's prefix: a
    # load that did not drop the prefix cache would reuse KV computed by the old weights.
    prompt = engine.prompt(" ".join(CORPUS[:5]))
    assert 128 < len(prompt) < 400
    (before,) = engine.generate_many([prompt], SamplingSpec(max_tokens=16, seed=5))
    assert max_gap(before.logprobs, reference_logprobs(old, prompt, before.token_ids)) < ATOL

    new = perturbed(old, seed=100 + engine.tied)
    if engine.tied:
        assert new.lm_head.weight is new.model.embed_tokens.weight
    else:
        assert not torch.equal(new.lm_head.weight, old.lm_head.weight)
    engine.load(new)

    gens = engine.generate_many([prompt, engine.prompt("Which way?")], SamplingSpec(max_tokens=16, seed=5))
    for p, gen in zip([prompt, engine.prompt("Which way?")], gens):
        assert max_gap(gen.logprobs, reference_logprobs(new, p, gen.token_ids)) < ATOL
        assert max_gap(gen.logprobs, reference_logprobs(old, p, gen.token_ids)) > 1e-2


def test_a_spooled_push_through_vllms_weight_transfer_api_matches_new_model(engine, tmp_path):
    """The push path: buckets in a spool file, applied by the `omrl_spool` engine registered in vLLM's
    weight-transfer factory (start_weight_update, one update_weights per bucket, finish_weight_update)."""
    old = engine.reference
    new = perturbed(old, seed=200 + engine.tied)
    weights = TensorWeights.of(list(new.state_dict().items()))
    with SpoolWriter(str(tmp_path)) as writer:
        for bucket in weights.buckets(bucket_bytes=64 << 10):  # many buckets, some tensors alone
            writer.add(bucket.specs, bucket.data)
    spool = writer.finish()
    assert len(spool.buckets) > 3
    try:
        engine.run(engine.backend.load_weight_spool(spool, version=7))
    finally:
        spool.delete()
    engine.reference = new
    prompt = engine.prompt("Which way?")
    (gen,) = engine.generate_many([prompt], SamplingSpec(max_tokens=16, seed=5))
    assert max_gap(gen.logprobs, reference_logprobs(new, prompt, gen.token_ids)) < ATOL
    assert max_gap(gen.logprobs, reference_logprobs(old, prompt, gen.token_ids)) > 1e-2
    assert engine.run(engine.backend.engine.get_weight_version()) == "7"


def test_eos_ends_generation_and_is_returned(engine):
    """Loads weights that make the eos likely (a constant residual direction that only the eos row
    of the head reads), then checks that sampling the eos stops with it included. Puts back the weights
    it found: on these, later tests' generations would end at the eos almost at once."""
    found = engine.reference
    model = perturbed(found, seed=0, scale=0.0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 3.0  # every token: a large constant in dim 0
        head = model.lm_head.weight  # the embedding itself when tied: +3 on every row is a
        head[engine.eos_id, 0] += 0.5  # constant logit shift, so only the eos row's extra counts
    engine.load(model)
    try:
        prompts = [engine.prompt(t) for t in ("Go left.", "Which way?", "Stop here.", "Room 7.")]
        gens = engine.generate_many(prompts, SamplingSpec(max_tokens=64, seed=21))
        for prompt, gen in zip(prompts, gens):
            assert gen.finish_reason == "stop", gen
            assert gen.token_ids[-1] == engine.eos_id and engine.eos_id not in gen.token_ids[:-1]
            assert len(gen.logprobs) == len(gen.token_ids)
            assert max_gap(gen.logprobs, reference_logprobs(model, prompt, gen.token_ids)) < ATOL
    finally:
        engine.load(found)
