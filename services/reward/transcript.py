"""An episode as chat messages: the prompt and each observation decoded with the policy's tokenizer (special tokens
dropped) as the user's, each model turn's text as the assistant's; what a model that reads text (a judge, a reward
model on `input: text`) is shown."""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]


def policy_decoder(tokenizer) -> Decode:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()


def episode_messages(traj, decode: Decode, turns: int | None = None) -> list[dict[str, str]]:
    """The messages of `traj`; with `turns`, only up to and including that many model turns (the observation after
    the last of them left out: what the judged turn had to go on and what it said, not what followed)."""
    ids = list(traj.token_ids)
    kept = list(traj.turns) if turns is None else list(traj.turns)[:turns]
    messages = [{"role": "user", "content": decode(ids[: traj.prompt_length])}]
    for index, turn in enumerate(kept):
        messages.append({"role": "assistant", "content": turn.text})
        if turn.env_tokens and (turns is None or index < len(kept) - 1):
            after = turn.start + turn.model_tokens
            messages.append({"role": "user", "content": decode(ids[after : after + turn.env_tokens])})
    return messages


def as_text(messages: list[dict[str, str]]) -> str:
    return "\n\n".join(f"{message['role'].title()}: {message['content']}" for message in messages)
