"""The built-in default model: a tiny random-init Llama and tokenizer built here (no hub needed),
warm-started on the task format. Real users pass `model.path` instead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from services.common.config import TrainConfig


def env_corpus(config: TrainConfig, episodes: int = 200, say: Callable[[str], None] | None = None) -> list[str]:
    """Text the tokenizer is trained on: what the env says and what a valid agent answers (random-policy
    episodes on `corpus_tasks`, the run's train tasks; every env is closed, and a task the env cannot play
    is skipped)."""
    from services.envs.demos import corpus_tasks, random_episodes

    if config.rollout.agent_loop == "tools":
        return tool_corpus(config, episodes, say)
    texts = []
    for demo in random_episodes(config.env, episodes, seed=config.seed, tasks=corpus_tasks(config.env), say=say):
        texts.append(demo.observation)
        for action, result in demo.steps:
            texts += [f"<action>{action}</action>", result.observation]
    return texts


def tool_corpus(config: TrainConfig, episodes: int, say: Callable[[str], None] | None) -> list[str]:
    """The same for the tool-calling loop: the tools' schemas, the calls in the run's format, their results."""
    import json

    from services.envs.demos import ToolTurn, corpus_tasks, random_tool_episodes
    from services.rollout.tool_parsers import TOOL_PARSERS

    parser = TOOL_PARSERS.create(config.rollout.tool_parser)
    texts = []
    for demo in random_tool_episodes(config.env, episodes, config.seed, corpus_tasks(config.env), say):
        texts += [demo.observation, *(json.dumps(tool) for tool in demo.tools)]
        for turn in demo.turns:
            if isinstance(turn, ToolTurn):
                texts += [parser.format_calls(turn.calls), *(result.content for result in turn.results)]
            else:
                texts += [f"<action> {turn[0]}</action>", turn[1].observation]
    return texts


WARMSTART_LR = 2e-3
TOOL_WARMSTART_LR = 1e-3


def prepare_tiny_model(
    config: TrainConfig, root: Path, say: Callable[[str], None] = print, warmstart_lr: float | None = None
) -> Path:
    """The tiny model for `config`, warm-started at `warmstart_lr` (default: `model.warmstart_lr`, else
    `TOOL_WARMSTART_LR` for the tool loop and `WARMSTART_LR` otherwise)."""
    from services.common.tiny_model import build_tiny_model
    from services.envs.registry import ENVS
    from services.learner.warmstart import warmstart

    # The tool tasks' agent copies numbers from a tool's result. Written digit by digit, a 2-layer model copies them
    # badly (digits repeat, so "the token after the one I just wrote" is ambiguous); in chunks of three they are
    # distinct tokens it copies as it copies words.
    # Tied embeddings make a copy one circuit for every number (attend to it, write its own embedding back)
    # instead of one output row learned per number; at warm-start lr 2e-3 that circuit formed and broke down again.
    # Invented names (tool_lookup's) are one token each for the same reason: in sub-word pieces the model misspelt
    # them in its searches, and a misspelt name finds nothing.
    tools = config.rollout.agent_loop == "tools"
    corpus = env_corpus(config, say=say)
    words = ENVS.get(config.env.name).whole_words(dict(config.env.options)) if tools else []
    base = build_tiny_model(
        root / "base", corpus, seed=config.seed, number_tokens=tools, tie_word_embeddings=tools, whole_words=words
    )
    if not config.model.warmstart_steps:
        return base
    say(f"warm-starting the tiny model on the {config.env.name} action format ({config.model.warmstart_steps} steps)")
    return warmstart(
        base,
        root / "warm",
        config.env,
        config.model.warmstart_steps,
        seed=config.seed,
        lr=warmstart_lr or config.model.warmstart_lr or (TOOL_WARMSTART_LR if tools else WARMSTART_LR),
        warmup_steps=config.model.warmstart_warmup_steps,
        say=say,
        read_observations=config.model.warmstart_reads_observations,
        tool_parser=config.rollout.tool_parser if tools else None,
    )
