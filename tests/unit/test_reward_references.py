import logging

import pytest
from prometheus_client import CollectorRegistry

from services.common.config import EnvConfig
from services.envs.datasets import dataset_dir
from services.reward.references import References, answers_of, parse_ground_truth
from tests.support.reference_data import write_references


@pytest.mark.parametrize(
    "raw, parsed",
    [
        ('{"answer": "7"}', {"answer": "7"}),
        ('"Paris"', "Paris"),
        ("0.50", "0.50"),  # a number keeps its spelling
        ("\\frac{1}{2}", "\\frac{1}{2}"),  # verl's plain-text ground truth
        ('["a", "b"]', ["a", "b"]),
        ("", None),
        ("  ", None),
        ("null", None),
        ('{"answer": ', None),  # a broken object is no answer, not the text "{..."
        (None, None),
    ],
)
def test_parse_ground_truth(raw, parsed):
    assert parse_ground_truth(raw) == parsed


def test_answers_of():
    assert answers_of({"answer": "7", "dataset": "x"}, "answer") == ["7"]
    assert answers_of({"answer": 7}, "answer") == ["7"]
    assert answers_of({"secret": "crane"}, "secret") == ["crane"]
    assert answers_of({"answer": ["Paris", "paris, France", ""]}, "answer") == ["Paris", "paris, France"]
    assert answers_of("Paris", "answer") == ["Paris"], "a bare answer whatever the key"
    assert answers_of({"answer": "7"}, "other") == []
    for none in [{}, {"answer": None}, None, ""]:
        assert answers_of(none, "answer") == []


def test_both_splits_are_looked_up(tmp_path):
    folder = write_references(tmp_path / "d", {0: {"answer": "1"}, 1: ""}, {2: {"answer": "3"}})
    refs = References(folder, metrics_registry=CollectorRegistry())
    assert refs.answers(0, "answer") == ["1"]
    assert refs.answers(2, "answer") == ["3"]
    assert refs.answers(1, "answer") == [] and refs.answers(99, "answer") == []


def test_a_task_in_both_splits_must_agree(tmp_path):
    same = write_references(tmp_path / "same", {0: {"answer": "1"}}, {0: {"answer": "1"}})
    assert References(same, metrics_registry=CollectorRegistry()).answers(0, "answer") == ["1"]
    differ = write_references(tmp_path / "differ", {0: {"answer": "1"}}, {0: {"answer": "2"}})
    with pytest.raises(ValueError, match="task 0 has rows with different ground truths"):
        References(differ, metrics_registry=CollectorRegistry()).answers(0, "answer")


def test_read_on_first_lookup_and_again_after_a_failed_read(tmp_path):
    refs = References(tmp_path / "later", metrics_registry=CollectorRegistry())  # no files yet: nothing read
    with pytest.raises(FileNotFoundError, match=r"later/train.parquet not found .*reachable from it"):
        refs.answers(0, "answer")
    write_references(tmp_path / "later", {0: {"answer": "1"}})
    assert refs.answers(0, "answer") == ["1"]


def test_folder_is_the_run_dataset(tmp_path):
    env = EnvConfig(name="reasoning", data_dir=str(tmp_path), options={"seed": 3})
    assert References.from_config(env, metrics_registry=CollectorRegistry()).folder == dataset_dir(env)


def test_missing_is_counted_and_logged_once_per_component(tmp_path, caplog):
    metrics = CollectorRegistry()
    refs = References(tmp_path, metrics_registry=metrics)
    refs.watch("exact_match")
    assert metrics.get_sample_value("omrl_reward_reference_missing_total", {"component": "exact_match"}) == 0
    with caplog.at_level(logging.WARNING, logger="services.reward.references"):
        for task in (4, 5, 6):
            refs.missing("exact_match", task, "zero")
        refs.missing("bleu", 7, "fail")
    assert metrics.get_sample_value("omrl_reward_reference_missing_total", {"component": "exact_match"}) == 3
    assert metrics.get_sample_value("omrl_reward_reference_missing_total", {"component": "bleu"}) == 1
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        f"reward component exact_match: task 4 has no reference answer in {tmp_path} (missing: zero)",
        f"reward component bleu: task 7 has no reference answer in {tmp_path} (missing: fail)",
    ]
