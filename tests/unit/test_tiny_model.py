"""The tiny demo model: its tokenizer, chat template, and that building it is deterministic."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from services.common.tiny_model import ACTION_TOKENS, END, SPECIAL_TOKENS, build_tiny_model  # noqa: E402

CORPUS = [
    f"You are in room {i} of a corridor with {i % 5 + 2} doors. The goal is to the "
    f"{'left' if i % 3 else 'right'}. Reply with <action>left</action> or <action>right</action>. "
    f"Thinking: the goal is {'behind' if i % 2 else 'ahead'}, so I go <action>{'left' if i % 3 else 'right'}</action>."
    for i in range(60)
] + ["The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs!"] * 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS)


@pytest.fixture(scope="module")
def tok(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize(
    "text",
    [
        "I go <action>left</action>.",
        "  leading spaces, trailing\ttab\nnew line  ",
        "unseen words: zyzzyva, naïve café, 東京, 🙂",
        "",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_special_tokens_round_trip(tok):
    text = "<|user|>hi<|end|><|assistant|>I go <action>left</action><|end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # <action> is an added token, not a special one: it survives skip_special_tokens.
    assert tok.decode(ids, skip_special_tokens=True) == "hiI go <action>left</action>"


def test_vocab_and_special_ids(tok, model_dir):
    assert 400 <= len(tok) <= 600
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3]
    assert tok.eos_token == END and tok.pad_token == "<|pad|>"
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == generation["eos_token_id"] == tok.eos_token_id
    assert config["vocab_size"] == len(tok)
    assert (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["head_dim"],
        config["intermediate_size"],
    ) == (128, 2, 2, 64, 256)
    assert config["max_position_embeddings"] == 1024 and config["dtype"] == "float32"


@pytest.mark.parametrize("token", ACTION_TOKENS)
def test_action_tags_are_single_tokens(tok, token):
    ids = tok.encode(token, add_special_tokens=False)
    assert len(ids) == 1 and tok.decode(ids) == token
    assert len(tok.encode(f"go {token}x", add_special_tokens=False)) >= 3


def test_chat_template(tok):
    messages = [
        {"role": "user", "content": "Which way?"},
        {"role": "assistant", "content": "<action>left</action>"},
        {"role": "user", "content": "Again."},
    ]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|user|>Which way?<|end|><|assistant|><action>left</action><|end|><|user|>Again.<|end|><|assistant|>"
    )
    assert tok.apply_chat_template(messages[:1], tokenize=False) == "<|user|>Which way?<|end|>"


def test_build_is_deterministic(tmp_path, model_dir):
    again = build_tiny_model(tmp_path / "again", CORPUS)
    files = sorted(p.name for p in model_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= set(files)
    for name in files:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_seed_and_tying_change_weights_only(tmp_path, model_dir):
    torch = pytest.importorskip("torch")
    other = build_tiny_model(tmp_path / "seed1", CORPUS, seed=1, tie_word_embeddings=True)
    assert (other / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(other)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert not torch.equal(base.model.embed_tokens.weight, model.model.embed_tokens.weight)


def test_warmstart_labels_replies_only_or_every_real_token():
    import torch

    from services.learner.warmstart import training_labels

    batch = [([5, 6, 7, 8], [0, 0, 1, 1]), ([9, 10], [0, 1])]
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert training_labels(ids, attention, batch, False).tolist() == [[-100, -100, 7, 8], [-100, 10, -100, -100]]
    assert training_labels(ids, attention, batch, True).tolist() == [[5, 6, 7, 8], [9, 10, -100, -100]]


WARMSTART_BATCHES = {
    "no common prefix": [([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 0, 1]), ([9, 10, 11], [0, 1, 1])],
    "a common prefix": [([5, 6, 7, 8, 9, 10], [0, 0, 0, 1, 0, 1]), ([5, 6, 7, 11], [0, 0, 1, 1])],
    "the same rows": [([5, 6, 7, 8], [0, 0, 1, 1]), ([5, 6, 7, 8], [0, 0, 1, 1])],
    "one row": [([5, 6, 7, 8], [0, 1, 0, 1])],
}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("batch", WARMSTART_BATCHES.values(), ids=WARMSTART_BATCHES)
def test_warmstart_loss_and_gradients_are_the_models_own(tmp_path, model_dir, tied, batch):
    """The warm-start's loss (its shared prefix run once, the head at labelled positions only) and its gradients
    are what the model computes on the whole batch."""
    import torch

    from services.learner.warmstart import next_token_loss, training_labels

    path = build_tiny_model(tmp_path / "m", CORPUS, seed=3, tie_word_embeddings=True) if tied else model_dir
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    width = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([row + [0] * (width - len(row)) for row, _ in batch])
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row, _ in batch])
    labels = training_labels(ids, attention, batch, False)

    def loss_and_grads(loss_fn):
        model.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    ours, our_grads = loss_and_grads(lambda: next_token_loss(model, ids, attention, labels))
    theirs, their_grads = loss_and_grads(lambda: model(input_ids=ids, attention_mask=attention, labels=labels).loss)
    assert ours == pytest.approx(theirs, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(our_grads, their_grads, strict=True))


def test_warmstart_episodes_ignore_the_hint(model_dir):
    """Reading observations must not teach which action is right: the warm-start's episodes come from a
    random policy, so its first moves agree with corridor's hint about half the time."""
    from transformers import AutoTokenizer

    from services.common.config import EnvConfig
    from services.learner.warmstart import demo_episodes
    from services.rollout.prompting import ChatFormatter

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    episodes = demo_episodes(EnvConfig(name="corridor"), ChatFormatter(tokenizer), tokenizer, count=200, seed=0)
    agree = 0
    for ids, _ in episodes:
        text = tokenizer.decode(ids)
        hint = text.split("The exit is to the ", 1)[1].split(".", 1)[0]
        first = text.split("<action>", 2)[2].split("</action>", 1)[0]  # [1] is the prompt's example
        agree += hint == first
    assert 0.35 < agree / len(episodes) < 0.65, agree


def test_warmstart_warmup_scales_the_first_steps(tmp_path, model_dir):
    """`warmup_steps` ramps the learning rate from lr/warmup_steps: Adam's first update moves each weight by about
    its learning rate, so the first step's largest change is a tenth of the unramped one with a warm-up of 10."""
    from safetensors.torch import load_file

    from services.common.config import EnvConfig
    from services.learner.warmstart import warmstart

    def largest_change(warmup: int) -> float:
        out = warmstart(
            model_dir, tmp_path / f"w{warmup}", EnvConfig(name="corridor"), steps=1, lr=1e-3, say=lambda _: None,
            warmup_steps=warmup,
        )  # fmt: skip
        before, after = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
        return max(float((after[name] - before[name]).abs().max()) for name in before)

    full, ramped = largest_change(0), largest_change(10)
    assert full == pytest.approx(1e-3, rel=0.05)
    assert ramped == pytest.approx(1e-4, rel=0.05)


def test_whole_words_are_one_token_each_and_decode_back(tmp_path):
    from services.envs.builtin.tool_lookup import ToolLookup, facts

    names = ToolLookup.whole_words({})
    assert names == [fact.name for fact in facts()] and len(set(names)) == len(names) == 500
    tok = transformers.AutoTokenizer.from_pretrained(build_tiny_model(tmp_path, CORPUS, whole_words=names))
    text = f'How deep is Lake {names[3]}? {{"query": "{names[3]} deep"}} {names[0]}.'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert [p for p in tok.convert_ids_to_tokens(ids) if p in names] == [names[3], names[3], names[0]]
    assert tok.decode(ids) == text
    plain = transformers.AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "plain", CORPUS))
    assert names[3] not in plain.convert_ids_to_tokens(plain(text, add_special_tokens=False)["input_ids"])


def test_number_tokens_write_numbers_in_chunks_of_three_from_the_left(tmp_path):
    numbered = build_tiny_model(tmp_path, CORPUS, number_tokens=True)
    tok = transformers.AutoTokenizer.from_pretrained(numbered)
    text = 'What is "679+899"? <action> 1578</action> fact-0123, 12345 and 7'
    pieces = tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])
    assert [p for p in pieces if p.isdigit()] == ["679", "899", "157", "8", "0", "123", "123", "45", "7"]
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    # without the option digits go through the BPE like any other character
    plain = transformers.AutoTokenizer.from_pretrained(build_tiny_model(tmp_path / "plain", CORPUS))
    assert "899" not in plain.convert_ids_to_tokens(plain(text, add_special_tokens=False)["input_ids"])
