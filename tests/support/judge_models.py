"""A tiny judge model for the tests: the tiny Llama (services.common.tiny_model) on a corpus where `Yes` and `No` are
one token each, and episodes built with its tokenizer (it is the policy's too)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "You are in a corridor. The exit is to the left.",
    "<action>left</action>",
    "<action>right</action>",
    "The wall is near.",
    "Did the agent reach the exit? Answer Yes or No.",
    "Yes",
    "No",
    "yes",
    "no",
    "Rate the episode from 0 to 10.",
] * 4
YES_NO_MARGIN = 2.0


def build_tiny_judge(out: Path, *, seed: int = 3, answers_yes_or_no: bool = False) -> Path:
    """The tiny Llama on CORPUS. `answers_yes_or_no`: its output rows of `Yes` and `No` pointed along the final hidden
    state of `<|assistant|>` (the last token of every judge prompt under its chat template), so that whatever it is
    asked both lead its first token's distribution by several logits, their odds still moved by the question: a random
    model whose yes/no verdict is a real probability, never missing from the top logprobs."""
    from services.common.tiny_model import ASSISTANT, build_tiny_model

    path = build_tiny_model(out, CORPUS, seed=seed)
    if answers_yes_or_no:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            hidden = model.model.norm(model.model.embed_tokens.weight[tokenizer.convert_tokens_to_ids(ASSISTANT)])
            for word in ("Yes", "No"):
                model.lm_head.weight[tokenizer.convert_tokens_to_ids(word)] += YES_NO_MARGIN * hidden / hidden.norm()
        model.save_pretrained(path)
    return Path(path)


def episode(tokenizer, replies: list[str], *, observation: str = "The wall is near.", tid: str = "t"):
    """A finished trajectory: the corridor prompt (CORPUS[0]), then each reply as a model turn, an observation between
    turns."""
    from tests.support.trajectories import chat_episode

    return chat_episode(tokenizer, CORPUS[0], replies, observation=observation, tid=tid)
