"""An LLM judge (verl's GenRM, SkyRL's and rLLM's LLM-as-judge): a generative model is asked a rubric question about
each episode, and its reply is read as a score in [0, 1].

- The question is `prompt`, a template naming `{task}`, `{conversation}` and `{final_answer}`
  (services.reward.verdicts), filled with the episode as text (services.reward.transcript: the policy's tokens
  decoded with `policy_tokenizer`) and rendered as one user message under the judge's chat template (as plain text
  when it has none).
- `verdict: yes_no`: P(yes) / (P(yes) + P(no)) from the first generated token's top logprobs (the model's own
  distribution, whatever the temperature); `number`: the first number of the reply, in [low, high], mapped onto [0, 1].
- The model is served by a vLLM engine this component owns, through the rollout's backend (`VllmBackend`), started
  when the component is built (the reward service is healthy once it has started).
- A verdict that does not come (`timeout`: past `timeout_s` from the Score call; `error`: the engine failed the
  request; `too_long`: the prompt does not fit `max_model_len`) or does not parse (`unparsable`) is `fallback`,
  counted in `omrl_reward_judge_fallbacks_total{component, reason}`; a Score call never waits past `timeout_s` for it.
- `per_turn`: a process reward: the judge is asked about each turn (the conversation up to and including it), every
  turn of every trajectory of the call at once; the episode's score is the sum of its turns'."""

from __future__ import annotations

import logging
import math
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field

from services.common import metrics, trust
from services.engines.base import SamplingSpec
from services.reward import transcript, verdicts
from services.reward.base import RewardFunction
from services.reward.judge_engine import Answer, JudgeEngine

log = logging.getLogger(__name__)

Verdict = Literal["yes_no", "number"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES = typing.get_args(Dtype)
YES_WORDS, NO_WORDS = ["Yes", "yes"], ["No", "no"]
"""The default words of a yes/no verdict (read, never changed)."""
REASONS = ("timeout", "unparsable", "error", "too_long")
FALLBACKS = metrics.counter(
    "reward", "judge_fallbacks_total", "Judge verdicts replaced by the fallback score", ["component", "reason"]
)
REQUEST_SECONDS = metrics.histogram(
    "reward",
    "judge_request_seconds",
    "From a Score call to a judge request's answer",
    ["component"],
    buckets=metrics.DURATION_BUCKETS,
)
VERDICTS = metrics.histogram(
    "reward",
    "judge_verdict",
    "Judge verdicts that parsed, in [0, 1]",
    ["component"],
    buckets=tuple(i / 10 for i in range(11)),
)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_tokenizer(path: str, what: str) -> Any:
    """The tokenizer of a model folder or id; ValueError naming `what` and what is wrong with `path`."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if what == "judge":
            AutoConfig.from_pretrained(path)  # vLLM reads it to build the engine
    except (OSError, ValueError) as exc:
        local = "a folder without a model" if Path(path).is_dir() else "no such folder, and not a reachable model id"
        raise ValueError(f"{what} {path!r}: {local}: {exc}") from None
    return tokenizer


def single_token_ids(tokenizer: Any, words: Sequence[str], param: str) -> set[int]:
    """The token id of each of `words`, each one token of the judge's tokenizer (the verdict is the first token)."""
    _check(
        not isinstance(words, str) and bool(words) and all(isinstance(w, str) and w for w in words),
        f"{param} must be a non-empty list of words",
    )
    ids = set()
    for word in words:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        _check(
            len(encoded) == 1,
            f"{param}: the judge's tokenizer writes {word!r} as {len(encoded)} tokens; list words of one token",
        )
        ids.add(encoded[0])
    return ids


class LlmJudge(RewardFunction):
    name = "llm_judge"

    def __init__(
        self,
        model: Annotated[str, Field(json_schema_extra=trust.MODEL)],
        policy_tokenizer: Annotated[str, Field(json_schema_extra=trust.MODEL)],
        prompt: Annotated[str, Field(min_length=1, max_length=100_000)],
        verdict: Verdict = "yes_no",
        low: float = 0.0,
        high: float = 10.0,
        yes: list[str] = YES_WORDS,
        no: list[str] = NO_WORDS,
        top_logprobs: Annotated[int, Field(ge=1, le=20)] = 20,
        max_tokens: Annotated[int, Field(ge=1, le=4096)] = 16,
        temperature: Annotated[float, Field(ge=0, le=10)] = 0.0,
        timeout_s: Annotated[float, Field(gt=0, le=3600)] = 20.0,
        fallback: float = 0.0,
        per_turn: bool = False,
        max_concurrency: Annotated[int, Field(ge=1, le=4096)] = 64,
        max_model_len: Annotated[int, Field(ge=16, le=1_048_576)] = 4096,
        dtype: Dtype = "auto",
        gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.05,
        kv_cache_bytes: Annotated[int, Field(ge=0)] = 0,
        enforce_eager: bool = True,
        start_timeout_s: Annotated[float, Field(gt=0, le=7200)] = 600.0,
    ):
        for param, value in (("model", model), ("policy_tokenizer", policy_tokenizer), ("prompt", prompt)):
            _check(isinstance(value, str) and bool(value), f"{param} must be a non-empty string, got {value!r}")
        verdicts.check_template(prompt)
        _check(verdict in ("yes_no", "number"), f"verdict must be yes_no or number, got {verdict!r}")
        for param, value in (("low", low), ("high", high), ("fallback", fallback)):
            _check(_is_number(value), f"{param} must be a finite number, got {value!r}")
        _check(low < high, f"the number range needs low < high, got [{low}, {high}]")
        for param, value, least, most in (
            ("top_logprobs", top_logprobs, 1, 20),  # vLLM's default max_logprobs
            ("max_tokens", max_tokens, 1, 4096),
            ("max_concurrency", max_concurrency, 1, 4096),
            ("max_model_len", max_model_len, 16, 1_048_576),
            ("kv_cache_bytes", kv_cache_bytes, 0, 2**50),
        ):
            _check(_is_int(value) and least <= value <= most, f"{param} must be an int in [{least}, {most}]")
        _check(_is_number(temperature) and 0 <= temperature <= 10, "temperature must be a number in [0, 10]")
        _check(
            _is_number(gpu_memory_utilization) and 0 < gpu_memory_utilization <= 1,
            "gpu_memory_utilization must be a number in (0, 1]",
        )
        for param, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            _check(_is_number(value) and value > 0, f"{param} must be a number > 0")
        for param, value in (("per_turn", per_turn), ("enforce_eager", enforce_eager)):
            _check(isinstance(value, bool), f"{param} must be true or false")
        _check(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")

        self.tokenizer = load_tokenizer(model, "judge")
        self.decode = transcript.policy_decoder(load_tokenizer(policy_tokenizer, "policy tokenizer"))
        self.yes_ids = single_token_ids(self.tokenizer, yes, "yes") if verdict == "yes_no" else set()
        self.no_ids = single_token_ids(self.tokenizer, no, "no") if verdict == "yes_no" else set()
        _check(not self.yes_ids & self.no_ids, "yes and no share a token")
        self.prompt, self.verdict, self.low, self.high = prompt, verdict, float(low), float(high)
        self.fallback, self.timeout_s, self.per_turn = float(fallback), float(timeout_s), per_turn
        self.max_model_len = max_model_len
        self.sampling = SamplingSpec(
            max_tokens=1 if verdict == "yes_no" else max_tokens,  # a yes/no verdict is the first token
            temperature=float(temperature),
            top_logprobs=top_logprobs if verdict == "yes_no" else 0,
        )
        self.engine_settings = dict(
            model=model,
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=float(gpu_memory_utilization),
            max_num_seqs=max_concurrency,
            enforce_eager=enforce_eager,
            engine_args={"kv_cache_memory_bytes": kv_cache_bytes} if kv_cache_bytes else {},
        )
        self.max_concurrency, self.start_timeout_s = max_concurrency, float(start_timeout_s)
        self._warned: set[str] = set()
        metrics.preset(FALLBACKS, *((self.name, reason) for reason in REASONS))
        self.engine = self.open_engine()

    def open_engine(self) -> JudgeEngine:
        """The rollout's vLLM backend on the judge model, started. Raw logprobs: a yes/no verdict reads the model's
        own distribution, not one reshaped by the sampling temperature. Its engine statistics feed the same
        `omrl_rollout_engine_*` gauges as a rollout engine's, in this process; vLLM's own `vllm:*` are off."""
        from services.engines.base import BACKENDS

        backend = BACKENDS.create("vllm", logprobs_mode="raw_logprobs", vllm_metrics=False, **self.engine_settings)
        return JudgeEngine(
            backend, max_concurrency=self.max_concurrency, start_timeout_s=self.start_timeout_s, name=self.name
        )

    def close(self) -> None:
        self.engine.close()

    def __call__(self, traj) -> float:
        return self.score_batch([traj])[0]

    def score_batch(self, trajs) -> list[float]:
        if self.per_turn:
            return [float(sum(turns)) for turns in self.score_turns_batch(trajs)]
        return self._judge([self.placeholders(traj) for traj in trajs])

    def score_turns(self, traj) -> list[float]:
        return self.score_turns_batch([traj])[0]

    def score_turns_batch(self, trajs) -> list[list[float]]:
        asked = [self.placeholders(traj, turns=i + 1) for traj in trajs for i in range(len(traj.turns))]
        scores = iter(self._judge(asked))
        return [[next(scores) for _ in traj.turns] for traj in trajs]

    def placeholders(self, traj, turns: int | None = None) -> dict[str, str]:
        """What the template's placeholders read for `traj`, or for its first `turns` turns."""
        messages = transcript.episode_messages(traj, self.decode, turns)
        judged = list(traj.turns)[: len(traj.turns) if turns is None else turns]
        return {
            "task": messages[0]["content"],
            "conversation": transcript.as_text(messages),
            "final_answer": judged[-1].text if judged else "",
        }

    def prompt_ids(self, question: str) -> list[int]:
        if self.tokenizer.chat_template:
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
            )
            return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        return list(self.tokenizer(question)["input_ids"])

    def _judge(self, asked: list[dict[str, str]]) -> list[float]:
        """One score per filled template: the verdict, or the fallback (counted) where there is none."""
        prompts = [self.prompt_ids(verdicts.render_template(self.prompt, values)) for values in asked]
        fits = [len(ids) < self.max_model_len for ids in prompts]
        answers = iter(
            self.engine.generate_many([p for p, ok in zip(prompts, fits) if ok], self.sampling, self.timeout_s)
        )
        scores = []
        for ids, ok in zip(prompts, fits):
            if not ok:
                scores.append(
                    self._fall_back("too_long", f"a prompt of {len(ids)} tokens, max_model_len {self.max_model_len}")
                )
                continue
            answer = next(answers)
            REQUEST_SECONDS.labels(self.name).observe(answer.seconds)
            score, reason, detail = self._read(answer)
            if score is None:
                scores.append(self._fall_back(reason, detail))
            else:
                VERDICTS.labels(self.name).observe(score)
                scores.append(score)
        return scores

    def _read(self, answer: Answer) -> tuple[float | None, str, str]:
        """(verdict, "", "") or, where there is none, (None, the fallback's reason, what happened)."""
        generation = answer.generation
        if generation is None:
            return None, answer.failure, answer.detail
        if not generation.token_ids:
            return None, "error", f"the engine returned no token (finish: {generation.finish_reason})"
        if self.verdict == "yes_no":
            top = generation.top_logprobs[0] if generation.top_logprobs else {}
            score = verdicts.yes_probability(top, self.yes_ids, self.no_ids)
            if score is None:
                said = self.tokenizer.decode(generation.token_ids[:1])
                return None, "unparsable", f"neither yes nor no among the first token's top logprobs (said {said!r})"
            return score, "", ""
        reply = self.tokenizer.decode(generation.token_ids, skip_special_tokens=True)
        score = verdicts.number_score(reply, self.low, self.high)
        if score is None:
            return None, "unparsable", f"no number in [{self.low:g}, {self.high:g}] in {reply[:80]!r}"
        return score, "", ""

    def _fall_back(self, reason: str, detail: str) -> float:
        FALLBACKS.labels(self.name, reason).inc()
        if reason not in self._warned:  # the first of each reason; the counter has the rest
            self._warned.add(reason)
            log.warning(
                "%s: no verdict (%s: %s); scored %g, as are later ones", self.name, reason, detail, self.fallback
            )
        return self.fallback
