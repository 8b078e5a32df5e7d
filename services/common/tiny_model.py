"""A tiny random-init Llama with a byte-level BPE tokenizer, written as a Hugging Face model dir.

Both vLLM and transformers load the result; it is the demo policy and the model every test uses.
`build_tiny_model` is a pure function of its arguments: the same corpus and seed give the same files
(timestamps aside), so a numerical change in a test shows up as a change, not as noise.

`build_random_model` is the one place random weights are made: it writes any transformers config (a smaller
Llama without a tokenizer for the learner's tests, a Qwen2.5 shape for the learner benchmark) the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

PAD, USER, ASSISTANT, END = "<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, USER, ASSISTANT, END]
"""Special tokens, ids 0..3 in this order; `END` is the eos."""
ACTION_TOKENS = ["<action>", "</action>"]
"""Added (not special) tokens: one id each, decoded as text."""
VOCAB_SIZE = 512
"""BPE target; a small corpus yields fewer merges, and the model's vocab is the tokenizer's length."""

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    + USER
    + 'Tools (call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>):'
    + "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor -%}"
    + END
    + "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    + USER
    + "{{ message['content'] }}"
    + END
    + "{%- elif message['role'] == 'assistant' -%}"
    + ASSISTANT
    + "{{ message['content'] }}"
    + END
    + "{%- elif message['role'] == 'tool' -%}"
    + USER
    + "<tool_response> {{ message['content'] }}</tool_response>"
    + END
    + "{%- else -%}{{ raise_exception('tiny model chat template: unsupported role ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + ASSISTANT + "{%- endif -%}"
)

MODEL_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,  # vLLM's CPU attention refuses head_dim 16
    intermediate_size=256,
    max_position_embeddings=1024,
)


NUMBER_TOKENS = [str(n) for n in range(1000)]
"""With `number_tokens`: one added token per number below 1000, so a number is written in chunks of up to three
digits from the left (`1436` as `143`, `6`), as Llama 3's and GPT-4's tokenizers write numbers."""


def _train_tokenizer(corpus: Sequence[str], number_tokens: bool = False, whole_words: Sequence[str] = ()):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer, length=len(corpus))
    # added tokens are matched leftmost-longest before the BPE sees the text: digits never reach its merges
    added = ACTION_TOKENS + (NUMBER_TOKENS if number_tokens else []) + list(whole_words)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok


def build_tiny_model(
    out_dir: str | Path,
    corpus: list[str],
    *,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    number_tokens: bool = False,
    whole_words: Sequence[str] = (),
) -> Path:
    """Writes config, float32 safetensors weights, generation config and tokenizer to `out_dir`. `number_tokens`:
    numbers are written in tokens of up to three digits (see `NUMBER_TOKENS`); `whole_words`: one added token each
    (`TextEnv.whole_words`)."""
    from transformers import GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

    if not corpus:
        raise ValueError("build_tiny_model needs a non-empty corpus to train the tokenizer on")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(corpus, number_tokens, whole_words),
        pad_token=PAD,
        eos_token=END,
        additional_special_tokens=[USER, ASSISTANT],
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    eos_id = tokenizer.convert_tokens_to_ids(END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **MODEL_SHAPE,
    )
    generation = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    build_random_model(out, config, seed=seed, generation_config=generation)
    tokenizer.save_pretrained(out)
    return out


def build_random_model(
    out_dir: str | Path,
    config,
    *,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    generation_config=None,
) -> Path:
    """Writes a causal LM of `config` (a transformers config of any architecture) with random weights drawn
    from `seed` on `device`, saved in `dtype` with `generation_config` (default: the one transformers derives
    from `config`). The caller's torch RNG state is left untouched. No tokenizer is written."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    on = torch.device(device)
    # Fork the global RNG so building a model leaves the caller's torch seed state untouched.
    with torch.random.fork_rng(devices=[on] if on.type == "cuda" else []), on:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    if generation_config is not None:
        model.generation_config = generation_config
    model.save_pretrained(out)
    return out
