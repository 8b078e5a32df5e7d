"""Supervised warm-start on the task format (the SFT that real pipelines run before RL): episodes of
a random valid policy, rendered with the model's chat template, teach the action format and nothing
about which action is right, so the policy starts near the random baseline."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from services.common.config import EnvConfig


def demo_episodes(
    env_cfg: EnvConfig, formatter, tokenizer, count: int, seed: int, say: Callable[[str], None] | None = None
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of `count` random-policy episodes, built exactly as the agent loop builds them, on
    `warmstart_tasks`: tasks no split reaches where the env makes each task from its index, so warm-start never
    plays an RL task; otherwise the run's own train split, the tasks known to be served."""
    from services.envs.demos import random_episodes, warmstart_tasks

    out = []
    eos = formatter.stop_token_ids[0] if tokenizer.eos_token_id is None else tokenizer.eos_token_id
    for demo in random_episodes(env_cfg, count, seed, tasks=warmstart_tasks(env_cfg, seed), say=say):
        ids = formatter.initial(demo.observation)
        mask = [0] * len(ids)
        for action, result in demo.steps:
            reply = tokenizer(f"<action>{action}</action>", add_special_tokens=False)["input_ids"] + [eos]
            ids, mask = ids + reply, mask + [1] * len(reply)
            if result.done:
                break
            obs_ids = formatter.observation(result.observation)
            ids, mask = ids + obs_ids, mask + [0] * len(obs_ids)
        out.append((ids, mask))
    return out


def training_labels(
    input_ids: torch.Tensor, attention: torch.Tensor, batch: list[tuple[list[int], list[int]]], read_observations: bool
) -> torch.Tensor:
    """Next-token targets: the agent's replies only, or (`read_observations`) every real token."""
    width = input_ids.shape[1]
    mask = (
        attention.bool()
        if read_observations
        else torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.bool)
    )
    return input_ids.masked_fill(~mask, -100)


def warmstart(
    base_dir: Path,
    out_dir: Path,
    env_cfg: EnvConfig,
    steps: int,
    seed: int = 0,
    batch_size: int = 16,
    lr: float = 2e-3,
    say: Callable[[str], None] = print,
    read_observations: bool = False,
) -> Path:
    """`read_observations` also trains next-token prediction on the prompts and observations, the way
    pretraining gives a real model its reading: the tiny model then picks up the environment's text (that
    a hint repeats from one observation to the next, say) while its actions stay those of the random
    policy, so the starting success rate is unchanged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.rollout.prompting import ChatFormatter

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    episodes = demo_episodes(
        env_cfg, ChatFormatter(tokenizer), tokenizer, count=max(256, batch_size * 8), seed=seed, say=say
    )
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id or 0
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        batch = rng.sample(episodes, batch_size)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        labels = training_labels(input_ids, attention, batch, read_observations)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 50 == 0 or step == steps:
            say(f"warm-start {step}/{steps}: loss {loss.item():.3f}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
