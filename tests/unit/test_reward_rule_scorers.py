import asyncio
import sys

import pytest
from prometheus_client import CollectorRegistry

from services.common.config import EnvConfig, RewardConfig
from services.common.errors import Internal
from services.reward.composer import RewardComposer
from services.reward.math_equiv import MathEquiv
from services.reward.math_worker import MathVerifier
from services.reward.reference_scorer import MissingReference
from services.reward.references import References
from services.reward.registry import REWARDS
from services.reward.sacrebleu_scores import Bleu, Chrf
from services.reward.service import RewardService
from services.reward.text_match import ExactMatch, TokenF1, normalize_answer, token_f1
from tests.support.reference_data import write_references
from tests.support.trajectories import answered

TRUTHS = {
    0: {"answer": "The Eiffel Tower", "city": "Paris"},
    1: {"answer": "1/2"},
    2: "42",
    3: {"answer": ["Paris", "Paris, France"]},
    4: {"answer": ""},
}


@pytest.fixture
def metrics():
    return CollectorRegistry()


@pytest.fixture
def references(tmp_path, metrics):
    return References(write_references(tmp_path / "data", TRUTHS), metrics_registry=metrics)


def bound(fn, references, component=None):
    fn.bind(references, component or fn.name)
    return fn


@pytest.mark.parametrize(
    "text, normal",
    [
        ("The  Eiffel Tower!", "eiffel tower"),
        ("an apple, a pear", "apple pear"),
        ("Theatre", "theatre"),  # articles are whole words only
        ("  1/2. ", "12"),
        ("", ""),
    ],
)
def test_normalize_answer_as_squad(text, normal):
    assert normalize_answer(text) == normal


def test_token_f1_arithmetic():
    # 2 common tokens; precision 2/3, recall 2/4 -> F1 = 2 * (2/3) * (1/2) / (2/3 + 1/2) = 4/7
    assert token_f1("big red dog", "a big red fluffy cat") == pytest.approx(4 / 7)
    assert token_f1("the the cat", "cat cat") == pytest.approx(2 / 3)  # repeated tokens count once per match
    assert token_f1("The cat.", "cat") == 1.0 and token_f1("dog", "cat") == 0.0
    assert token_f1("", "the") == 1.0 and token_f1("", "cat") == 0.0  # both empty after normalising: agree


def test_exact_match_and_f1_take_the_best_reference(references):
    exact, f1 = bound(ExactMatch(), references), bound(TokenF1(), references)
    assert exact(answered(0, "the eiffel tower.")) == 1.0
    assert exact(answered(0, "Eiffel")) == 0.0
    assert f1(answered(0, "Eiffel")) == pytest.approx(2 / 3)
    assert exact(answered(3, "paris france")) == 1.0
    assert f1(answered(3, "Paris Texas")) == pytest.approx(2 / 3)  # against "Paris": 1/2 precision, full recall
    assert exact(answered(2, "42")) == 1.0, "a bare JSON ground truth is the answer itself"


def test_bleu_and_chrf_scale_to_one(references):
    for cls in (Bleu, Chrf):
        fn = bound(cls(), references)
        assert fn(answered(0, "The Eiffel Tower")) == 1.0
        assert 0.0 < fn(answered(0, "The Eiffel Towers")) < 1.0
        assert fn(answered(0, "")) == 0.0
    assert Bleu().score("the cat sat on a mat", ["the cat sat on the mat"]) == pytest.approx(0.5373, abs=1e-4)


def test_key_and_source_params(references):
    assert bound(ExactMatch(key="city"), references)(answered(0, "paris")) == 1.0
    assert bound(ExactMatch(key="city"), references)(answered(0, "The Eiffel Tower")) == 0.0
    traj = answered(0, "", text="I think: The Eiffel Tower")
    assert bound(ExactMatch(), references)(traj) == 0.0, "no parsed action: an empty answer"
    assert bound(ExactMatch(source="text"), references)(answered(0, "", text="the Eiffel Tower")) == 1.0
    assert bound(TokenF1(source="text"), references)(traj) == pytest.approx(2 / 3)  # "i think eiffel tower"


@pytest.mark.parametrize(
    "params, message",
    [
        ({"key": ""}, "key must be a non-empty string"),
        ({"key": 3}, "key must be a non-empty string"),
        ({"source": "txt"}, "source must be one of action, text; got 'txt'"),
        ({"missing": "skip"}, "missing must be one of zero, fail; got 'skip'"),
    ],
)
def test_bad_params_are_rejected_at_construction(params, message):
    for cls in (ExactMatch, TokenF1, Bleu, Chrf, MathEquiv):
        with pytest.raises(ValueError, match=message):
            cls(**params)


def test_bad_params_are_rejected_by_the_config():
    with pytest.raises(ValueError, match="components.math_equiv.params.timeout_s"):
        RewardConfig(components={"math_equiv": {"params": {"timeout_s": 0}}})
    with pytest.raises(ValueError, match="components.bleu.params.keys"):
        RewardConfig(components={"bleu": {"params": {"keys": "answer"}}})
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds"):
        MathEquiv(timeout_s=-1)


def test_registered_and_bound_by_the_composer(tmp_path):
    assert {"exact_match", "token_f1", "bleu", "chrf", "math_equiv"} <= set(REWARDS.names())
    components = {"exact_match": {"weight": 2.0}, "goal": {}}
    with pytest.raises(ValueError, match="'exact_match' scores against the task dataset's reference answers"):
        RewardComposer(components)
    write_references(tmp_path / "reasoning", {0: {"answer": "7"}})
    config = RewardConfig(components=components)
    composer = RewardComposer.from_config(config, EnvConfig(name="reasoning", data_dir=str(tmp_path)))
    assert composer.score(answered(0, "7"))[1] == {"exact_match": 2.0, "goal": 0.0}


def test_a_missing_reference_scores_zero_and_is_counted(references, metrics):
    composer = RewardComposer({"exact_match": {}, "token_f1": {"weight": 0.5}, "goal": {}}, references=references)
    service = RewardService(composer, metrics_registry=metrics)

    def missing(component):
        return metrics.get_sample_value("omrl_reward_reference_missing_total", {"component": component})

    assert missing("exact_match") == 0 and missing("goal") is None
    # task 4's answer is empty, task 99 has no row
    scores = asyncio.run(service.score([answered(4, "x"), answered(99, "x"), answered(2, "42")]))
    assert [s.total for s in scores] == [0.0, 0.0, 1.5]
    assert missing("exact_match") == 2 and missing("token_f1") == 2


def test_missing_fail_fails_the_batch(references):
    fn = bound(ExactMatch(missing="fail"), references)
    with pytest.raises(MissingReference, match="task 99 has no reference answer"):
        fn(answered(99, "x"))
    service = RewardService(RewardComposer({"exact_match": {"params": {"missing": "fail"}}}, references=references))
    with pytest.raises(Internal, match="component 'exact_match' failed on trajectory 't': MissingReference"):
        asyncio.run(service.score([answered(2, "42"), answered(99, "x")]))


def test_math_equivalence_in_worker_threads(references):
    fn = bound(MathEquiv(), references)
    cases = [("0.5", 1, 1.0), ("\\frac{1}{2}", 1, 1.0), ("The answer is $\\frac{2}{4}$", 1, 1.0), ("0.25", 1, 0.0)]
    cases += [("42.0", 2, 1.0), ("41", 2, 0.0)]

    async def in_threads():  # as the service calls reward functions: off the main thread, several at once
        return await asyncio.gather(*(asyncio.to_thread(fn, answered(task, answer)) for answer, task, _ in cases))

    try:
        assert asyncio.run(in_threads()) == [want for _, _, want in cases]
    finally:
        fn.verifier.close()


def test_math_check_out_of_time_scores_zero_and_restarts_the_worker():
    hang = "import time; print('{\"ready\": true}', flush=True); time.sleep(60)"
    verifier = MathVerifier(0.3, command=(sys.executable, "-c", hang))
    try:
        assert verifier.equal("1", ["1"]) is None
        assert verifier._proc is None, "the stuck child is killed"
        assert verifier.equal("1", ["1"]) is None  # a fresh child, stuck too
    finally:
        verifier.close()
    broken = MathVerifier(5, command=(sys.executable, "-c", 'print(\'{"error": "no math-verify"}\', flush=True)'))
    with pytest.raises(RuntimeError, match="worker did not start: no math-verify"):
        broken.equal("1", ["1"])
