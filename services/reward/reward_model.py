"""A reward model: a Hugging Face sequence-classification model with one label (verl's discriminative RM, OpenRLHF's
reward model) scores each episode, its batches shared by the concurrent Score calls (services.reward.batcher).

What the model reads (`input`):
- `tokens`: the episode's own token ids, as the policy saw and wrote them (its chat template, its observations):
  for a reward model trained on the policy's tokenizer, the usual setup; the last `max_length` tokens when longer;
- `text`: the conversation re-rendered under the reward model's own chat template: the prompt and each observation
  decoded with the policy's tokenizer (`policy_tokenizer`, a path or id), each model turn's text, as user and
  assistant messages.

With `per_turn` it is a process reward model: it scores each turn by what the model reads up to the end of that
turn's model tokens (the observation after it not included), every turn of the batch in the same passes.

On a causal classifier a batch runs each distinct token once (`share_prefixes`; services.reward.shared_forward):
a group's common prompt, the turns its episodes played alike, and a process reward model's turns of one episode."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from services.common import metrics, trust
from services.reward.base import RewardFunction
from services.reward.batcher import Batcher
from services.reward.shared_forward import Plan, SharedForward, pad_right
from services.reward.transcript import episode_messages

log = logging.getLogger(__name__)

Input = Literal["tokens", "text"]
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_SIZE = metrics.histogram(
    "reward", "model_batch_size", "Trajectories per reward-model forward", ["component"], buckets=SIZE_BUCKETS
)
FORWARD_SECONDS = metrics.histogram("reward", "model_forward_seconds", "Reward-model forward", ["component"])
TOKENS = metrics.counter(
    "reward",
    "model_tokens_total",
    "Reward-model tokens: given in inputs, and computed once shared prefixes and repeats are run once",
    ["component", "what"],
)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def load_classifier(path: str, dtype: str, device: str) -> tuple[Any, Any]:
    """(tokenizer, model) of a one-label sequence classifier; ValueError naming what is wrong with `path`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as exc:
        local = "a folder without a model" if Path(path).is_dir() else "no such folder, and not a reachable model id"
        raise ValueError(f"reward model {path!r}: {local}: {exc}") from None
    labels = model.config.num_labels
    _check(labels == 1, f"reward model {path!r} has {labels} labels; a reward model scores with one")
    set_pad_token(model, tokenizer, f"reward model {path!r}")
    return tokenizer, model.to(device).eval()


def shared_forward(model, pad_id: int, device: str, min_shared_tokens: int) -> SharedForward | None:
    """Prefix sharing for a causal classifier whose head reads one token (Hugging Face's generic one); None for
    others (an encoder's tokens see what follows them)."""
    try:
        from transformers.modeling_layers import GenericForSequenceClassification
    except ImportError:  # an older transformers: the plain forward
        return None
    if not isinstance(model, GenericForSequenceClassification) or model.config.is_encoder_decoder:
        return None
    return SharedForward(getattr(model, model.base_model_prefix), pad_id, device, min_shared_tokens)


def set_pad_token(model, tokenizer, what: str) -> None:
    """The model's pad token, else its tokenizer's, into `model.config`; ValueError naming `what` without either."""
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.pad_token_id
    _check(pad is not None, f"{what} names no pad token: batches need one to find each last token")
    model.config.pad_token_id = pad


class RewardModel(RewardFunction):
    name = "reward_model"

    def __init__(
        self,
        path: Annotated[str, Field(json_schema_extra=trust.MODEL)],
        input: Input = "tokens",
        policy_tokenizer: Annotated[str, Field(json_schema_extra=trust.MODEL)] = "",
        max_batch: Annotated[int, Field(ge=1, le=4096)] = 32,
        max_wait_ms: Annotated[float, Field(ge=0, le=10_000)] = 5.0,
        max_length: Annotated[int, Field(ge=8, le=1_048_576)] = 4096,
        device: str = "auto",
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        per_turn: bool = False,
        share_prefixes: bool = True,
        min_shared_tokens: Annotated[int, Field(ge=1, le=1_048_576)] = 32,
    ):
        _check(isinstance(path, str) and bool(path), f"path must name a model folder or id, got {path!r}")
        _check(input in ("tokens", "text"), f"input must be tokens or text, got {input!r}")
        _check(
            input == "tokens" or bool(policy_tokenizer),
            "input text decodes with the policy's tokenizer: set policy_tokenizer",
        )
        for param, value, low in (("max_batch", max_batch, 1), ("max_length", max_length, 8)):
            _check(
                isinstance(value, int) and not isinstance(value, bool) and value >= low,
                f"{param} must be an int >= {low}",
            )
        _check(isinstance(max_wait_ms, (int, float)) and max_wait_ms >= 0, "max_wait_ms must be a number >= 0")
        for param, value in (("per_turn", per_turn), ("share_prefixes", share_prefixes)):
            _check(isinstance(value, bool), f"{param} must be true or false, got {value!r}")
        _check(
            isinstance(min_shared_tokens, int) and not isinstance(min_shared_tokens, bool) and min_shared_tokens >= 1,
            "min_shared_tokens must be an int >= 1",
        )
        self.per_turn = per_turn
        import torch

        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.tokenizer, self.model = load_classifier(path, dtype, self.device)
        self.input, self.max_length = input, max_length
        self.policy = None
        if input == "text":
            from transformers import AutoTokenizer

            self.policy = AutoTokenizer.from_pretrained(policy_tokenizer)
        self.pad_id = int(self.model.config.pad_token_id)
        self.vocab = int(self.model.config.vocab_size)
        self.shared = (
            shared_forward(self.model, self.pad_id, self.device, min_shared_tokens) if share_prefixes else None
        )
        self.batcher = Batcher(self._forward, max_batch, max_wait_ms / 1000, self._observe)

    def _observe(self, size: int, seconds: float) -> None:
        BATCH_SIZE.labels(self.name).observe(size)
        FORWARD_SECONDS.labels(self.name).observe(seconds)

    def __call__(self, traj) -> float:
        return sum(self.score_turns(traj)) if self.per_turn else self.score_batch([traj])[0]

    def score_batch(self, trajs) -> list[float]:
        if self.per_turn:
            return [sum(scores) for scores in self.score_turns_batch(trajs)]
        return self.batcher.submit([self.input_ids(t) for t in trajs])

    def score_turns(self, traj) -> list[float]:
        return self.score_turns_batch([traj])[0]

    def score_turns_batch(self, trajs) -> list[list[float]]:
        inputs = [self.input_ids(t, turns=k + 1) for t in trajs for k in range(len(t.turns))]
        flat, out = iter(self.batcher.submit(inputs)), []
        for traj in trajs:
            out.append([next(flat) for _ in traj.turns])
        return out

    def input_ids(self, traj, turns: int | None = None) -> list[int]:
        """What the model reads of `traj`; with `turns`, of its prompt and first `turns` turns' model tokens."""
        if self.input == "tokens":
            ids = list(traj.token_ids)
            if turns is not None:
                last = traj.turns[turns - 1]
                ids = ids[: last.start + last.model_tokens]
        else:
            ids = self._rendered(traj, turns)
        ids = ids[-self.max_length :]
        beyond = max(ids, default=0)
        _check(
            beyond < self.vocab,
            f"token id {beyond} is outside the reward model's vocabulary ({self.vocab}): input text",
        )
        return ids

    def _rendered(self, traj, turns: int | None = None) -> list[int]:
        messages = episode_messages(
            traj, lambda part: self.policy.decode(part, skip_special_tokens=True).strip(), turns
        )
        if self.tokenizer.chat_template:
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=True)
            return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        return self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"]

    def _forward(self, batch: list[list[int]]) -> list[float]:
        import torch

        TOKENS.labels(self.name, "given").inc(sum(len(ids) for ids in batch))
        if self.shared is not None:
            plan = Plan.of(batch, self.pad_id)
            with torch.inference_mode():
                hidden, computed = self.shared.run(plan)
                scores = self.model.score(torch.stack([hidden[read] for read in plan.reads]))[:, 0]
            TOKENS.labels(self.name, "computed").inc(computed)
            return scores.float().cpu().tolist()
        TOKENS.labels(self.name, "computed").inc(len(batch) * max(len(ids) for ids in batch))
        input_ids, mask = pad_right(batch, self.pad_id)
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()
