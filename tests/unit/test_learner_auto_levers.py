"""The learner's `auto` settings (services/learner/levers.py): the fast levers on a GPU, sized from its memory and
the model; what CPU runs best on CPU; a hand-set value kept; `deterministic` and `share_prefix` respected."""

import pytest
from transformers import LlamaConfig, Qwen2Config

from services.learner import levers
from tests.support.learner import make_config

GIB = 2**30
QWEN_05B = Qwen2Config(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
)
LLAMA_7B = LlamaConfig(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000
)


@pytest.fixture
def gpu_kernels(monkeypatch):
    monkeypatch.setattr(levers, "varlen_available", lambda: True)
    monkeypatch.setattr(levers, "compiler_available", lambda: True)


def chosen(config):
    learner, algo = config.learner, config.algorithm
    return (
        learner.pack_sequences,
        learner.attention,
        learner.compile,
        learner.logprob_chunk_tokens,
        learner.activation_checkpointing,
        algo.micro_batch_tokens,
    )


def test_on_cpu_auto_is_what_cpu_runs_best():
    assert chosen(levers.resolve(make_config(), "cpu")) == (False, "sdpa", False, 4096, False, 0)


def test_on_a_gpu_auto_turns_every_lever_on_and_sizes_micro_batches_from_its_memory(gpu_kernels):
    on_h200 = levers.resolve(make_config(), "cuda", QWEN_05B, 139 * GIB)
    assert chosen(on_h200) == (True, "varlen", True, 16384, False, 65536)
    on_24gb = levers.resolve(make_config(), "cuda", QWEN_05B, 24 * GIB)
    assert on_24gb.algorithm.micro_batch_tokens == 8192 and on_24gb.learner.activation_checkpointing is True


def test_the_token_budget_grows_with_memory_and_processes_and_shrinks_with_a_critic():
    shape = levers.ModelShape.of(LLAMA_7B)
    assert 6.5e9 < shape.params < 7.0e9 and 480e6 < levers.ModelShape.of(QWEN_05B).params < 500e6

    def budget(gib, world=1, critic=False, checkpointed=False):
        return levers.token_budget(shape, gib * GIB, world, 16384, checkpointed, critic, reference=False)

    assert budget(139) == levers.MIN_TOKENS  # a 7B's states alone fill most of one H200
    assert budget(139, world=4) < budget(139, world=4, checkpointed=True)
    assert budget(139, world=4, critic=True) < budget(139, world=4)
    assert budget(80, world=4) < budget(139, world=4) <= levers.MAX_TOKENS
    for tokens in (budget(80, world=4), budget(139, world=8, checkpointed=True)):
        assert tokens % levers.TOKEN_STEP == 0


def test_a_7b_on_one_gpu_checkpoints_its_activations(gpu_kernels):
    config = levers.resolve(make_config(), "cuda", LLAMA_7B, 139 * GIB)
    assert config.learner.activation_checkpointing is True
    assert config.algorithm.micro_batch_tokens == levers.MIN_TOKENS


def test_hand_set_values_stay_and_what_follows_from_them_adapts(gpu_kernels):
    padded = levers.resolve(make_config({"pack_sequences": False}), "cuda", QWEN_05B, 139 * GIB)
    assert chosen(padded) == (False, "sdpa", True, 16384, False, 0)
    fixed = make_config({"compile": False, "logprob_chunk_tokens": 0}, micro_batch_tokens=8192)
    assert chosen(levers.resolve(fixed, "cuda", QWEN_05B, 139 * GIB)) == (True, "varlen", False, 0, False, 8192)
    shared = levers.resolve(make_config({"share_prefix": True}), "cuda", QWEN_05B, 139 * GIB)
    assert chosen(shared)[:2] == (False, "sdpa") and shared.learner.activation_checkpointing is False


def test_deterministic_runs_keep_the_cpu_choices_on_a_gpu(gpu_kernels):
    deterministic = make_config().model_copy(update={"deterministic": True})
    config = levers.resolve(deterministic, "cuda", QWEN_05B, 139 * GIB)
    assert chosen(config) == (False, "sdpa", False, 4096, False, 0)


def test_a_gpu_without_the_varlen_kernel_or_a_compiler_gets_padded_eager_rows(monkeypatch):
    monkeypatch.setattr(levers, "varlen_available", lambda: False)
    monkeypatch.setattr(levers, "compiler_available", lambda: False)
    config = levers.resolve(make_config(), "cuda", QWEN_05B, 139 * GIB)
    assert chosen(config) == (False, "sdpa", False, 16384, False, 0)


def test_auto_passes_the_configs_checks_that_hand_set_values_still_meet():
    assert make_config({"share_prefix": True}).learner.pack_sequences == "auto"
    assert make_config({"attention": "varlen"}).learner.attention == "varlen"
    with pytest.raises(ValueError, match="unset learner.pack_sequences"):
        make_config({"share_prefix": True, "pack_sequences": True})
    with pytest.raises(ValueError, match="set learner.pack_sequences"):
        make_config({"attention": "varlen", "pack_sequences": False})


def fake_gpu(monkeypatch, hf_config, memory):
    import torch
    from transformers import AutoConfig

    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda path: hf_config)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": memory}))
    return torch.device("cuda")


def test_the_longest_trainable_row_grows_with_memory_and_checkpointing(monkeypatch, gpu_kernels):
    gpu = fake_gpu(monkeypatch, QWEN_05B, 141 * GIB)
    config = levers.resolve(make_config(), "cuda", QWEN_05B, 141 * GIB)
    longest = levers.longest_row(config, gpu, "qwen", 1)
    assert longest >= config.algorithm.micro_batch_tokens  # a micro-batch's budget is at most what fits
    checkpointed = config.model_copy(deep=True)
    checkpointed.learner.activation_checkpointing = True
    assert levers.longest_row(checkpointed, gpu, "qwen", 1) > 4 * longest
    eager = config.model_copy(deep=True)
    eager.learner.compile = False  # eager layers keep more of each token's activations
    assert levers.longest_row(eager, gpu, "qwen", 1) == pytest.approx(longest / levers.EAGER_ACTIVATIONS, abs=1)
    small = fake_gpu(monkeypatch, QWEN_05B, 24 * GIB)
    assert levers.longest_row(config, small, "qwen", 1) < longest


def test_no_longest_row_on_cpu_nor_with_attention_that_grows_with_the_square(monkeypatch):
    import torch

    config = make_config()
    assert levers.longest_row(levers.resolve(config, "cpu"), torch.device("cpu"), "unused", 1) is None
    gpu = fake_gpu(monkeypatch, QWEN_05B, 141 * GIB)
    eager = make_config({"attention": "eager"})
    assert levers.longest_row(levers.resolve(eager, "cuda", QWEN_05B, 141 * GIB), gpu, "qwen", 1) is None
