"""The built-in default model: a tiny random-init Llama and tokenizer built here (no hub needed),
warm-started on the task format. Real users pass `model.path` instead."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from services.common.config import TrainConfig


def env_corpus(config: TrainConfig, episodes: int = 200) -> list[str]:
    """Text the tokenizer is trained on: what the env says and what a valid agent answers."""
    from services.envs.registry import ENVS

    rng, texts = random.Random(config.seed), []
    for i in range(episodes):
        env = ENVS.create(config.env.name)
        texts.append(env.reset(i, dict(config.env.options)))
        for _ in range(config.env.max_turns):
            action = env.random_action(rng)
            texts.append(f"<action>{action}</action>")
            result = env.step(action)
            texts.append(result.observation)
            if result.done:
                break
    return texts


def prepare_tiny_model(config: TrainConfig, root: Path, say: Callable[[str], None] = print) -> Path:
    from services.common.tiny_model import build_tiny_model
    from services.learner.warmstart import warmstart

    base = build_tiny_model(root / "base", env_corpus(config), seed=config.seed)
    if not config.model.warmstart_steps:
        return base
    say(f"warm-starting the tiny model on the {config.env.name} action format ({config.model.warmstart_steps} steps)")
    return warmstart(
        base,
        root / "warm",
        config.env,
        config.model.warmstart_steps,
        seed=config.seed,
        say=say,
        read_observations=config.model.warmstart_reads_observations,
    )
