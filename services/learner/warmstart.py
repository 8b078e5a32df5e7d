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
    env_cfg: EnvConfig,
    formatter,
    tokenizer,
    count: int,
    seed: int,
    say: Callable[[str], None] | None = None,
    tool_parser: str | None = None,
) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of `count` random-policy episodes, built exactly as the agent loop builds them, on
    `warmstart_tasks`: tasks no split reaches where the env makes each task from its index, so warm-start never
    plays an RL task; otherwise the run's own train split, the tasks known to be served. `tool_parser`: episodes of
    the tool-calling loop, its calls written in that parser's format."""
    from services.envs.demos import random_episodes, warmstart_tasks

    eos = formatter.stop_token_ids[0] if tokenizer.eos_token_id is None else tokenizer.eos_token_id
    if tool_parser is not None:
        return tool_demo_episodes(env_cfg, formatter, tokenizer, count, seed, eos, tool_parser, say)
    out = []
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


def tool_demo_episodes(
    env_cfg: EnvConfig, formatter, tokenizer, count: int, seed: int, eos: int, tool_parser: str, say=None
) -> list[tuple[list[int], list[int]]]:
    """A random tool user's episodes (`services.envs.demos.random_tool_episodes`) as the tool-calling loop records
    them: the tools in the first prompt, the calls in the parser's format, their results as `tool` messages."""
    from services.envs.demos import ToolTurn, random_tool_episodes, warmstart_tasks
    from services.rollout.tool_loop import tool_message
    from services.rollout.tool_parsers import TOOL_PARSERS

    parser, out = TOOL_PARSERS.create(tool_parser), []
    for demo in random_tool_episodes(env_cfg, count, seed, warmstart_tasks(env_cfg, seed), say):
        ids = formatter.initial(demo.observation, tools=demo.tools or None)
        mask = [0] * len(ids)
        for turn in demo.turns:
            if isinstance(turn, ToolTurn):
                text = parser.format_calls(turn.calls)
                after = formatter.tool_results([tool_message(result) for result in turn.results])
            else:
                # after a space, as the tiny template writes a tool's output: a copy starts after the same token
                text, after = (
                    f"<action> {turn[0]}</action>",
                    None if turn[1].done else formatter.observation(turn[1].observation),
                )
            reply = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            ids, mask = ids + reply, mask + [1] * len(reply)
            if after is None:
                break
            ids, mask = ids + after, mask + [0] * len(after)
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


def next_token_loss(model, input_ids: torch.Tensor, attention: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of the labelled next tokens (what `model(labels=...).loss` computes) for less work: the
    rows' common prefix (a tool demo's tool schemas and prompt, about 60% of its tokens) runs once and its keys and
    values serve every row, and the output head runs at the labelled positions only (where the warm-start does not
    read observations, the replies alone: about an eighth of a tool demo's tokens)."""
    from transformers import DynamicCache

    rows, width = input_ids.shape
    differs = (input_ids != input_ids[:1]).any(dim=0) | (attention == 0).any(dim=0)
    # the first column that differs (or is padding), leaving at least one token to the rest
    shared = min(int(differs.int().argmax()) if bool(differs.any()) else width, width - 1)
    decoder = model.get_decoder()
    if rows > 1 and shared > 0:
        cache = DynamicCache(config=model.config)
        prefix = decoder(input_ids=input_ids[:1, :shared], past_key_values=cache, use_cache=True).last_hidden_state
        cache.batch_repeat_interleave(rows)
        rest = decoder(input_ids=input_ids[:, shared:], attention_mask=attention, past_key_values=cache, use_cache=True)
        hidden = torch.cat([prefix.expand(rows, -1, -1), rest.last_hidden_state], dim=1)
    else:
        hidden = decoder(input_ids=input_ids, attention_mask=attention).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])
    return torch.nn.functional.cross_entropy(logits.float(), targets[keep])


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
    tool_parser: str | None = None,
    warmup_steps: int = 0,
) -> Path:
    """`read_observations` also trains next-token prediction on the prompts and observations, the way
    pretraining gives a real model its reading: the tiny model then picks up the environment's text (that
    a hint repeats from one observation to the next, say) while its actions stay those of the random
    policy, so the starting success rate is unchanged. `warmup_steps`: the learning rate rises linearly to `lr`
    over these first steps (step k at k/warmup_steps of it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.rollout.prompting import ChatFormatter

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    episodes = demo_episodes(
        env_cfg,
        ChatFormatter(tokenizer),
        tokenizer,
        # tool demos differ in long numbers to copy: as many as the steps read, or the model learns them by heart
        count=max(256, batch_size * 8, steps * batch_size // 2 if tool_parser else 0),
        seed=seed,
        say=say,
        tool_parser=tool_parser,
    )
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    ramp = max(1, warmup_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optim, lambda done: min(1.0, (done + 1) / ramp))
    pad = tokenizer.pad_token_id or 0
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        batch = rng.sample(episodes, batch_size)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in batch])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
        labels = training_labels(input_ids, attention, batch, read_observations)
        loss = next_token_loss(model, input_ids, attention, labels)
        optim.zero_grad()
        loss.backward()
        optim.step()
        schedule.step()
        if step % 50 == 0 or step == steps:
            say(f"warm-start {step}/{steps}: loss {loss.item():.3f}")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
