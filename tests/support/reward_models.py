"""Tiny reward models for the tests: a one-label Llama sequence classifier on the demo policy's tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

CORPUS = ["You are in a corridor. The exit is to the left.", "<action>left</action>", "<action>right</action>"]


def build_tiny_policy(out: Path) -> Path:
    from services.common.tiny_model import build_tiny_model

    return build_tiny_model(out, CORPUS)


def build_tiny_reward_model(out: Path, policy: Path, *, seed: int = 0, num_labels: int = 1) -> Path:
    """The policy's shape, tokenizer and chat template, a fresh score head of `num_labels`, random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(policy)
    config.num_labels = num_labels
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return Path(out)


def agent_like_rows(vocab: int, seed: int = 0) -> list[list[int]]:
    """Three groups of five: a prompt each, turns the episodes share in part, one repeat, one episode that is an
    earlier turn of another, and the pad token (0, the tiny tokenizer's) inside and at the end of a row."""
    pad, rng = 0, random.Random(seed)
    rows = []
    for _ in range(3):
        prompt = [rng.randrange(1, vocab) for _ in range(40)]
        first_turn = [rng.randrange(1, vocab) for _ in range(12)]
        played = [
            prompt + first_turn + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 30))] for _ in range(3)
        ]
        played[2][45] = pad
        rows += played + [list(played[0]), prompt + first_turn + [pad, pad]]
    rows.append(rows[0][:50])
    return rows
