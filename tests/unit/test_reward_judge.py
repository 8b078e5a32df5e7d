"""The `llm_judge` component on a rule-backed engine (the real vLLM path: tests/integration/test_reward_judge_vllm.py):
verdicts read from a reply or from the first token's top logprobs, a template or a param that cannot work refused at
construction, every verdict that does not come or does not parse replaced by the fallback and counted, per-turn
scores one per turn with every turn asked at once."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
from prometheus_client import REGISTRY
from pydantic import ValidationError

from services.common.config import RewardConfig
from services.common.registry import Registry
from services.engines.base import Generation, RolloutBackend
from services.reward.composer import RewardComposer
from services.reward.judge import LlmJudge
from services.reward.judge_engine import JudgeEngine
from services.reward.verdicts import check_template, number_score, yes_probability
from tests.support.judge_models import build_tiny_judge, episode

ASK = "Task: {task}\nEpisode:\n{conversation}\nLast reply: {final_answer}\nDid the agent go left? Answer Yes or No."
YES_TOP = {"Yes": 0.7, "yes": 0.1, "No": 0.15, ".": 0.05}
NO_TOP = {"No": 0.6, "Yes": 0.2, ".": 0.2}
YES_SCORE, NO_SCORE = 0.8 / 0.95, 0.2 / 0.8
"""The stub's first-token distributions after a `Yes` or a `No` reply, and the verdicts they make."""


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> str:
    return str(build_tiny_judge(tmp_path_factory.mktemp("judge")))


@pytest.fixture(scope="module")
def tokenizer(judge_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(judge_dir)


LAST_LEFT, LAST_RIGHT = "Last reply: <action>left</action>", "Last reply: <action>right</action>"


def went_left(question: str) -> str:
    return "Yes" if LAST_LEFT in question else "No"


class RuleBackend(RolloutBackend):
    """A judge by rule: `reply(question text)` is its answer; `SLEEP` never comes, `BOOM` fails the request. After a
    `Yes` or `No` its first token's top logprobs are YES_TOP or NO_TOP, after anything else its own token alone."""

    name = "rule"

    def __init__(self, tokenizer, reply=went_left, start_s: float = 0.0, delay_s: float = 0.0):
        self.tokenizer, self.reply, self.start_s, self.delay_s = tokenizer, reply, start_s, delay_s
        self.questions: list[str] = []
        self.samplings = []
        self.in_flight = self.peak = 0

    async def start(self) -> None:
        await asyncio.sleep(self.start_s)

    def _id(self, word: str) -> int:
        (token,) = self.tokenizer.encode(word, add_special_tokens=False)
        return token

    async def generate(self, request_id, prompt_ids, sampling) -> Generation:
        question = self.tokenizer.decode(prompt_ids)
        self.questions.append(question)
        self.samplings.append(sampling)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            reply = self.reply(question)
            if reply == "SLEEP":
                await asyncio.sleep(3600)
            if reply == "BOOM":
                raise RuntimeError("judge engine fell over")
        finally:
            self.in_flight -= 1
        ids = self.tokenizer.encode(reply, add_special_tokens=False)[: sampling.max_tokens]
        top = {"Yes": YES_TOP, "No": NO_TOP}.get(reply)
        first = {self._id(w): math.log(p) for w, p in top.items()} if top else {ids[0]: 0.0}
        listed = [first] + [{t: 0.0} for t in ids[1:]] if sampling.top_logprobs else []
        return Generation(ids, [0.0] * len(ids), "stop", top_logprobs=listed)

    async def load_weights(self, named_tensors) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        pass


class RuleJudge(LlmJudge):
    """The judge on a RuleBackend instead of a vLLM engine."""

    def __init__(self, backend: RuleBackend, **params):
        self.backend = backend
        super().__init__(**params)

    def open_engine(self) -> JudgeEngine:
        return JudgeEngine(
            self.backend, max_concurrency=self.max_concurrency, start_timeout_s=self.start_timeout_s, name=self.name
        )


@pytest.fixture
def make_judge(judge_dir, tokenizer):
    built = []

    def make(reply=went_left, backend: RuleBackend | None = None, **params) -> RuleJudge:
        backend = backend or RuleBackend(tokenizer, reply)
        judge = RuleJudge(backend, **{"model": judge_dir, "policy_tokenizer": judge_dir, "prompt": ASK, **params})
        built.append(judge)
        return judge

    yield make
    for judge in built:
        judge.close()


def fallbacks(reason: str) -> float:
    labels = {"component": "llm_judge", "reason": reason}
    return REGISTRY.get_sample_value("omrl_reward_judge_fallbacks_total", labels) or 0.0


def trajectories(tokenizer):
    return [
        episode(tokenizer, ["<action>right</action>", "<action>left</action>"], tid="left-last"),
        episode(tokenizer, ["<action>left</action>", "<action>right</action>"], tid="right-last"),
        episode(tokenizer, ["<action>left</action>"], tid="left-only"),
    ]


# -- verdicts -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "reply, low, high, score",
    [
        ("8", 0, 10, 0.8),
        ("Score: 7/10, good", 0, 10, 0.7),
        ("3.5 out of 10", 0, 10, 0.35),
        ("I'd say .5", 0, 1, 0.5),
        ("5", 1, 5, 1.0),
        ("1", 1, 5, 0.0),
        ("-2", -5, 5, 0.3),
        ("42", 0, 10, None),
        ("-1", 0, 10, None),
        ("no verdict here", 0, 10, None),
        ("", 0, 10, None),
    ],
)
def test_a_number_verdict_is_the_first_number_mapped_from_its_range_onto_0_1(reply, low, high, score):
    found = number_score(reply, low, high)
    assert found == (None if score is None else pytest.approx(score))


def test_a_yes_no_verdict_is_the_yes_share_of_the_yes_and_no_probability():
    yes_ids, no_ids = {1, 2}, {3}
    lp = {1: math.log(0.6), 2: math.log(0.1), 3: math.log(0.1), 4: math.log(0.2)}
    assert yes_probability(lp, yes_ids, no_ids) == pytest.approx(0.7 / 0.8)
    assert yes_probability({1: -0.1, 4: -3.0}, yes_ids, no_ids) == 1.0  # no below every listed token: probability 0
    assert yes_probability({3: -0.1, 4: -3.0}, yes_ids, no_ids) == 0.0
    assert yes_probability({4: -0.1, 5: -3.0}, yes_ids, no_ids) is None  # neither listed: no verdict
    assert yes_probability({}, yes_ids, no_ids) is None
    # far-off logprobs still compare (exp underflows to 0 for both), and -inf is probability 0
    assert yes_probability({1: -1000.0, 3: -1001.0}, yes_ids, no_ids) == pytest.approx(1 / (1 + math.exp(-1)))
    assert yes_probability({1: -math.inf, 3: -2.0}, yes_ids, no_ids) == 0.0
    assert yes_probability({1: -math.inf, 3: -math.inf}, yes_ids, no_ids) is None


@pytest.mark.parametrize(
    "template, error",
    [
        ("Judge {answer}", r"names \{answer\}; it may name \{task\}, \{conversation\}, \{final_answer\}"),
        ("Judge {}", r"names \{\}"),
        ("Judge {0}", r"names \{0\}"),
        ("Judge {task.upper}", r"names \{task.upper\}"),
        ("Judge {task!r}", "without a conversion or format spec"),
        ("Judge {task:>20}", "without a conversion or format spec"),
        ("Judge {task", "write a literal brace as {{ or }}"),
        ("Judge the episode } please {task}", "write a literal brace"),
        ("Judge the episode", "names none of"),
    ],
)
def test_a_template_that_cannot_be_filled_is_refused(template, error):
    with pytest.raises(ValueError, match=error):
        check_template(template)


def test_a_template_may_hold_literal_braces_doubled():
    check_template('Reply as JSON {{"score": n}} about {conversation}')


# -- params ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, error",
    [
        ({"verdict": "maybe"}, "verdict must be yes_no or number"),
        ({"verdict": "number", "low": 5, "high": 5}, r"low < high, got \[5, 5\]"),
        ({"fallback": math.nan}, "fallback must be a finite number"),
        ({"top_logprobs": 0}, r"top_logprobs must be an int in \[1, 20\]"),
        ({"top_logprobs": 21}, r"top_logprobs must be an int in \[1, 20\]"),
        ({"max_tokens": 2.0}, "max_tokens must be an int"),
        ({"timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"temperature": -1}, "temperature must be a number"),
        ({"per_turn": "yes"}, "per_turn must be true or false"),
        ({"yes": "Yes"}, "yes must be a non-empty list of words"),
        ({"no": []}, "no must be a non-empty list of words"),
        ({"yes": ["Absolutely"]}, "writes 'Absolutely' as [0-9]+ tokens; list words of one token"),
        ({"yes": ["Yes"], "no": ["Yes"]}, "yes and no share a token"),
        ({"prompt": "{verdict}"}, r"names \{verdict\}"),
        ({"prompt": ""}, "prompt must be a non-empty string"),
        ({"dtype": "int8"}, "dtype must be one of auto, float32, bfloat16, float16, got 'int8'"),
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ],
)
def test_a_bad_param_fails_at_construction(make_judge, params, error):
    with pytest.raises(ValueError, match=error):
        make_judge(**params)


def test_a_judge_model_that_does_not_exist_fails_at_construction_before_any_engine_starts(judge_dir, tmp_path):
    ask = {"policy_tokenizer": judge_dir, "prompt": ASK}
    with pytest.raises(ValueError, match="judge '/nonexistent/judge': no such folder"):
        LlmJudge(model="/nonexistent/judge", **ask)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="a folder without a model"):
        LlmJudge(model=str(tmp_path / "empty"), **ask)
    with pytest.raises(ValueError, match="policy tokenizer '/nonexistent/policy': no such folder"):
        LlmJudge(model=judge_dir, policy_tokenizer="/nonexistent/policy", prompt=ASK)
    with pytest.raises(ValueError, match="reward component 'llm_judge': bad params .*judge '/nonexistent/judge'"):
        RewardComposer({"llm_judge": {"params": {"model": "/nonexistent/judge", **ask}}})


def test_the_run_config_checks_the_params_types_before_any_service_starts():
    ask = {"model": "/models/judge", "policy_tokenizer": "/models/policy", "prompt": ASK}
    RewardConfig.model_validate({"components": {"llm_judge": {"params": ask}}})
    for bad in ({"yes": "Yes"}, {"timeout_s": "5"}, {"verdict": "score"}, {"top_logprobs": 50}, {"judge": "x"}):
        with pytest.raises(ValidationError):
            RewardConfig.model_validate({"components": {"llm_judge": {"params": {**ask, **bad}}}})
    with pytest.raises(ValidationError, match="prompt"):
        RewardConfig.model_validate({"components": {"llm_judge": {"params": {"model": "m", "policy_tokenizer": "p"}}}})


def test_a_judge_or_remote_deadline_not_below_the_score_calls_is_refused_at_submit():
    """Past reward.timeout_s the whole group fails: a judge's fallback or a remote server's error must come first."""
    ask = {"model": "/models/judge", "policy_tokenizer": "/models/policy", "prompt": ASK}
    RewardConfig.model_validate({"timeout_s": 30, "components": {"llm_judge": {"params": ask}}})  # its 20 s default
    with pytest.raises(ValidationError, match=r"'llm_judge' waits up to timeout_s=20 s, not below reward.timeout_s=10"):
        RewardConfig.model_validate({"timeout_s": 10, "components": {"llm_judge": {"params": ask}}})
    RewardConfig.model_validate({"timeout_s": 10, "components": {"llm_judge": {"params": {**ask, "timeout_s": 8}}}})
    servers = {"servers": {"rm": "127.0.0.1:1"}, "timeout_s": 30}
    with pytest.raises(ValidationError, match="'remote' waits up to timeout_s=30 s"):
        RewardConfig.model_validate({"timeout_s": 30, "components": {"remote": {"params": servers}}})


# -- scoring --------------------------------------------------------------------------------------------------------
def test_yes_no_verdicts_are_probabilities_asked_under_the_judges_chat_template(make_judge, tokenizer):
    judge = make_judge()
    trajs = trajectories(tokenizer)
    assert judge.score_batch(trajs) == pytest.approx([YES_SCORE, NO_SCORE, YES_SCORE])
    first = judge.backend.questions[0]
    assert first.startswith("<|user|>Task: " + "You are in a corridor. The exit is to the left.")
    assert first.endswith("Answer Yes or No.<|end|><|assistant|>")
    assert "User: The wall is near." in first and "Assistant: <action>right</action>" in first
    (sampling,) = {(s.max_tokens, s.temperature, s.top_logprobs) for s in judge.backend.samplings}
    assert sampling == (1, 0.0, 20)  # the verdict is the first token: one generated, its top logprobs read


def composer_of(judge: LlmJudge, weight: float) -> RewardComposer:
    registry = Registry("reward function")
    registry.register("llm_judge")(lambda **params: judge)
    return RewardComposer({"llm_judge": {"weight": weight}}, registry=registry)


def test_number_verdicts_and_the_weighted_breakdown_through_the_composer(make_judge, tokenizer):
    judge = make_judge(lambda q: "8 of 10" if LAST_LEFT in q else "2 of 10", verdict="number", max_tokens=4)
    scored = composer_of(judge, 2.0).score_many(trajectories(tokenizer))
    assert [s[1]["llm_judge"] for s in scored] == pytest.approx([1.6, 0.4, 1.6])
    assert {(s.max_tokens, s.top_logprobs) for s in judge.backend.samplings} == {(4, 0)}


@pytest.mark.parametrize(
    "reply, reason",
    [(lambda q: "SLEEP", "timeout"), (lambda q: "the the the", "unparsable"), (lambda q: "BOOM", "error")],
    ids=["timeout", "garbage", "error"],
)
def test_a_verdict_that_does_not_come_or_parse_is_the_fallback_and_counted(make_judge, tokenizer, reply, reason):
    """The others of the batch keep their verdicts; a judge that never answers holds the call for timeout_s only."""
    trajs = trajectories(tokenizer)
    failing = lambda q: reply(q) if LAST_RIGHT in q else went_left(q)  # noqa: E731
    judge = make_judge(failing, fallback=-1.0, timeout_s=0.5)
    before = {r: fallbacks(r) for r in ("timeout", "unparsable", "error", "too_long")}
    start = time.monotonic()
    assert judge.score_batch(trajs) == pytest.approx([YES_SCORE, -1.0, YES_SCORE])
    took = time.monotonic() - start
    after = {r: fallbacks(r) for r in before}
    assert {r: after[r] - before[r] for r in before} == {r: float(r == reason) for r in before}
    if reason == "timeout":
        assert 0.5 <= took < 0.5 + 5.0, took
        assert judge.backend.in_flight == 0  # the late request was cancelled, not left running


def test_a_prompt_longer_than_the_judges_context_is_the_fallback_without_asking(make_judge, tokenizer):
    judge = make_judge(fallback=0.25, max_model_len=64)
    before = fallbacks("too_long")
    assert judge.score_batch(trajectories(tokenizer)) == [0.25] * 3
    assert fallbacks("too_long") - before == 3 and judge.backend.questions == []


def test_a_hung_engine_loop_still_releases_the_caller(make_judge, tokenizer, monkeypatch):
    """A backend that blocks its event loop (a bug) cannot hold a Score call past timeout_s + the cancel grace."""
    import services.reward.judge_engine as judge_engine

    def block(question):
        time.sleep(2.0)  # in the loop's thread: nothing else of the loop runs meanwhile
        return "Yes"

    judge = make_judge(block, timeout_s=0.2)
    monkeypatch.setattr(judge_engine, "CANCEL_GRACE_S", 0.3)
    before = fallbacks("timeout")
    start = time.monotonic()
    assert judge.score_batch(trajectories(tokenizer)[:1]) == [0.0]
    assert time.monotonic() - start < 1.5 and fallbacks("timeout") - before == 1


# -- per turn -------------------------------------------------------------------------------------------------------
def test_per_turn_asks_about_each_turn_with_the_conversation_up_to_it_all_at_once(make_judge, tokenizer):
    backend = RuleBackend(tokenizer, delay_s=0.2)
    judge = make_judge(backend=backend, per_turn=True)
    assert judge.per_turn
    trajs = trajectories(tokenizer)
    turns = judge.score_turns_batch(trajs)
    assert turns == [
        pytest.approx([NO_SCORE, YES_SCORE]),
        pytest.approx([YES_SCORE, NO_SCORE]),
        pytest.approx([YES_SCORE]),
    ]
    assert backend.peak == 5  # every turn of every trajectory in flight together
    shown = {q.split("Episode:\n")[1].split("\nLast reply:")[0] for q in backend.questions}
    task, wall = "User: You are in a corridor. The exit is to the left.", "User: The wall is near."
    right, left = "Assistant: <action>right</action>", "Assistant: <action>left</action>"
    # up to and including the judged turn; the observation after it not shown
    assert shown == {
        "\n\n".join(parts)
        for parts in ([task, right], [task, right, wall, left], [task, left], [task, left, wall, right])
    }
    assert judge.score_batch(trajs) == pytest.approx([sum(t) for t in turns])  # the episode: the sum of its turns
    scored = composer_of(judge, 0.5).score_many(trajs)
    assert [s.turns for s in scored] == [pytest.approx([0.5 * v for v in t]) for t in turns]


def test_max_concurrency_bounds_the_requests_in_flight(make_judge, tokenizer):
    backend = RuleBackend(tokenizer, delay_s=0.05)
    judge = make_judge(backend=backend, per_turn=True, max_concurrency=2)
    judge.score_turns_batch(trajectories(tokenizer))
    assert backend.peak == 2 and len(backend.questions) == 5


# -- the engine's loop ----------------------------------------------------------------------------------------------
def test_an_engine_that_does_not_start_in_time_fails_construction_and_leaves_no_thread(make_judge, tokenizer):
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(RuntimeError, match="did not start within 0.2s"):
        make_judge(backend=RuleBackend(tokenizer, start_s=30), start_timeout_s=0.2)
    assert "llm_judge-engine" not in {t.name for t in threading.enumerate()} - before


def test_concurrent_score_calls_from_worker_threads_share_the_engine(make_judge, tokenizer):
    backend = RuleBackend(tokenizer, delay_s=0.5)
    judge = make_judge(backend=backend)
    trajs, out = trajectories(tokenizer), {}
    callers = [threading.Thread(target=lambda i=i: out.update({i: judge.score_batch(trajs)})) for i in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(10)
    assert all(out[i] == pytest.approx([YES_SCORE, NO_SCORE, YES_SCORE]) for i in range(4))
    assert backend.peak > 3  # several calls' requests in flight together
