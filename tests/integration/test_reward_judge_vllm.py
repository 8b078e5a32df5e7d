"""The `llm_judge` component on a real vLLM engine (CPU), one engine for the module: a tiny judge whose first reply
token is Yes or No (tests/support/judge_models.py) scores episodes through RewardComposer, its verdicts the model's own
P(yes) / (P(yes) + P(no)) as transformers computes it; per turn, a reply that is no number, and an engine that does
not answer in time each give their counted fallback, and the engine serves on after the timeout."""

from __future__ import annotations

import time

import psutil
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from prometheus_client import REGISTRY  # noqa: E402

from services.reward.composer import RewardComposer  # noqa: E402
from services.reward.judge import LlmJudge  # noqa: E402
from services.reward.verdicts import render_template  # noqa: E402
from tests.support.judge_models import build_tiny_judge, episode  # noqa: E402
from tests.support.processes import vllm_children  # noqa: E402

ASK = "Task: {task}\nEpisode:\n{conversation}\nLast reply: {final_answer}\nDid the agent reach the exit? Yes or No."
WEIGHT = 2.0


def judge_params(model: str) -> dict:
    return {
        "model": model,
        "policy_tokenizer": model,
        "prompt": ASK,
        "yes": ["Yes"],
        "no": ["No"],
        "fallback": -1.0,
        "timeout_s": 120.0,
        "dtype": "float32",
        "max_model_len": 512,
        "max_concurrency": 8,
    }


class SharedEngineJudge(LlmJudge):
    """Another judge component on the module's engine (one engine start for the module)."""

    def __init__(self, engine, **params):
        self.shared = engine
        super().__init__(**params)

    def open_engine(self):
        return self.shared


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = str(build_tiny_judge(tmp_path_factory.mktemp("judge"), answers_yes_or_no=True))
    start = time.monotonic()
    composer = RewardComposer({"llm_judge": {"weight": WEIGHT, "params": judge_params(model)}})
    print(f"\njudge engine started in {time.monotonic() - start:.1f}s")
    judge = composer.components[0][2]
    try:
        yield model, composer, judge
    finally:
        judge.close()
        psutil.wait_procs(vllm_children(), timeout=30)
        assert not vllm_children(), "vLLM processes left after the judge closed"


@pytest.fixture(scope="module")
def trajs(served):
    tokenizer = transformers.AutoTokenizer.from_pretrained(served[0])
    replies = [["<action>left</action>"], ["<action>right</action>", "<action>left</action>"], ["go left"]]
    return [episode(tokenizer, r, tid=f"t{i}") for i, r in enumerate(replies)]


def reference_verdict(model, judge: LlmJudge, values: dict[str, str]) -> float:
    """P(Yes) / (P(Yes) + P(No)) of the judge's first token, from a transformers forward pass."""
    ids = judge.prompt_ids(render_template(ASK, values))
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
    (yes,), (no,) = judge.yes_ids, judge.no_ids
    return float(probs[yes] / (probs[yes] + probs[no]))


def fallbacks(reason: str) -> float:
    labels = {"component": "llm_judge", "reason": reason}
    return REGISTRY.get_sample_value("omrl_reward_judge_fallbacks_total", labels) or 0.0


def test_the_judge_on_vllm_scores_what_the_model_says_and_falls_back_where_it_cannot(served, trajs):
    model_dir, composer, judge = served
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # episode verdicts through the composer: the model's own yes probability, weighted into the breakdown
    scored = composer.score_many(trajs)
    verdicts = [parts["llm_judge"] / WEIGHT for _, parts, *_ in scored]
    expected = [reference_verdict(reference, judge, judge.placeholders(t)) for t in trajs]
    assert verdicts == pytest.approx(expected, abs=2e-3)
    assert all(0.0 < v < 1.0 for v in verdicts) and len({round(v, 4) for v in verdicts}) == len(verdicts)

    # per turn, on the same engine: one verdict per turn, each about the conversation up to that turn
    per_turn = SharedEngineJudge(judge.engine, **judge_params(model_dir), per_turn=True)
    turns = per_turn.score_turns_batch(trajs)
    assert [len(t) for t in turns] == [len(t.turns) for t in trajs]
    expected_turns = [
        [reference_verdict(reference, judge, judge.placeholders(t, turns=k + 1)) for k in range(len(t.turns))]
        for t in trajs
    ]
    assert turns == [pytest.approx(e, abs=2e-3) for e in expected_turns]

    # asked for a number, the random judge's reply holds none: the fallback, counted
    before = fallbacks("unparsable")
    by_number = SharedEngineJudge(judge.engine, **judge_params(model_dir), verdict="number", max_tokens=1)
    assert by_number.score_batch(trajs) == [-1.0] * len(trajs)
    assert fallbacks("unparsable") - before == len(trajs)

    # an engine that does not answer (paused: requests queued, no step runs) gives the fallback at timeout_s
    llm = judge.engine.backend.engine
    impatient = SharedEngineJudge(judge.engine, **{**judge_params(model_dir), "timeout_s": 0.5})
    before = fallbacks("timeout")
    judge.engine.run(llm.pause_generation(mode="keep", clear_cache=False), 60)
    try:
        start = time.monotonic()
        assert impatient.score_batch(trajs) == [-1.0] * len(trajs)
        took = time.monotonic() - start
    finally:
        judge.engine.run(llm.resume_generation(), 60)
    assert 0.5 <= took < 5.0, took
    assert fallbacks("timeout") - before == len(trajs)
    deadline = time.monotonic() + 30
    while llm.output_processor.get_num_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert llm.output_processor.get_num_unfinished_requests() == 0  # the late requests were aborted
    assert [parts["llm_judge"] / WEIGHT for _, parts, *_ in composer.score_many(trajs)] == pytest.approx(verdicts)
