"""Preference pairs from played episodes (services/reward/preference_pairs.py) and the Bradley-Terry trainer
(services/reward/train_rm.py): a success is paired only with a failure of its own task; the trained classifier
ranks held-out pairs of the rule it was taught and loads as the `reward_model` component."""

import json

import pytest

from services.common.trajectory import Trajectory
from services.reward.preference_pairs import Pair, pair_episodes, read_pairs, write_pairs
from services.reward.reward_model import RewardModel
from services.reward.train_rm import REPORT_FILE, Settings, main, split_by_group, train_reward_model
from tests.support.reward_models import build_tiny_policy


def played(task: int, success: bool, *ids: int, env: str = "corridor") -> Trajectory:
    return Trajectory(env=env, task_index=task, success=success, token_ids=list(ids))


def test_each_success_is_paired_with_failures_of_its_own_task():
    trajs = [
        played(1, True, 10),
        played(1, False, 11),
        played(1, False, 12),
        played(2, False, 20),  # no success: no pair
        played(3, True, 30),  # no failure: no pair
        played(4, False, 40),
        played(4, True, 41),
        played(4, True, 42),
        played(1, True, 13, env="maze"),  # another env's task 1
    ]
    pairs = pair_episodes(trajs, seed=0)
    assert sorted((p.group, p.chosen[0], p.rejected[0]) for p in pairs) == [
        ("corridor/1", 10, 11),
        ("corridor/1", 10, 12),
        ("corridor/4", 41, 40),
        ("corridor/4", 42, 40),
    ]


def test_pairs_per_task_are_capped_and_drawn_from_the_seed():
    trajs = [played(7, True, i) for i in range(4)] + [played(7, False, 100 + i) for i in range(4)]
    draws = [[(p.chosen[0], p.rejected[0]) for p in pair_episodes(trajs, seed=s, max_per_task=3)] for s in (0, 0, 1)]
    assert len(draws[0]) == 3 and len(set(draws[0])) == 3
    assert draws[0] == draws[1] and draws[0] != draws[2]
    with pytest.raises(ValueError, match="max_per_task"):
        pair_episodes(trajs, seed=0, max_per_task=0)


def test_pairs_round_trip_through_jsonl_and_a_bad_line_is_named(tmp_path):
    pairs = [Pair([1, 2], [3], "corridor/1"), Pair([4], [5, 6], "corridor/2")]
    assert read_pairs(write_pairs(pairs, tmp_path / "pairs.jsonl")) == pairs
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"chosen": [1], "rejected": [2]}) + "\n" + json.dumps({"chosen": [1]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a pair"):
        read_pairs(bad)
    bad.write_text(json.dumps({"chosen": [1, -2], "rejected": [2]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*token ids"):
        read_pairs(bad)


def test_the_held_out_part_takes_whole_groups():
    pairs = [Pair([i], [i + 1], f"task/{i % 5}") for i in range(20)]
    train, held = split_by_group(pairs, 0.4, seed=0)
    held_groups = {p.group for p in held}
    assert len(held_groups) == 2 and len(train) + len(held) == 20
    assert not held_groups & {p.group for p in train}
    assert split_by_group(pairs, 0.0, seed=0) == (pairs, [])


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return str(build_tiny_policy(tmp_path_factory.mktemp("policy")))


def taught_pairs(policy: str) -> list[Pair]:
    """Chosen: the episode ends in `left`; rejected: the same episode ending in `right`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    ids = lambda text: tok(text)["input_ids"]  # noqa: E731
    return [
        Pair(ids(f"cell {i} of {j}. <action>left</action>"), ids(f"cell {i} of {j}. <action>right</action>"), f"t{i}")
        for i in range(8)
        for j in range(3)
    ]


def test_the_trained_model_ranks_held_out_pairs_and_serves_as_the_reward_model(policy, tmp_path):
    pairs = taught_pairs(policy)
    settings = Settings(epochs=3, batch_size=8, lr=2e-3, held_out=0.25)
    report = train_reward_model(pairs, policy, tmp_path / "rm", settings)
    assert (report.train_pairs, report.held_out_pairs) == (18, 6)
    assert report.epoch_loss[-1] < report.epoch_loss[0]
    assert report.held_out_accuracy == 1.0
    assert json.loads((tmp_path / "rm" / REPORT_FILE).read_text())["held_out_accuracy"] == 1.0
    rm = RewardModel(str(tmp_path / "rm"), max_wait_ms=0)
    _, held = split_by_group(pairs, settings.held_out, settings.seed)
    for pair in held:
        chosen, rejected = (rm(Trajectory(token_ids=side)) for side in (pair.chosen, pair.rejected))
        assert chosen > rejected


def test_pairs_of_another_tokenizer_fail_before_training(policy, tmp_path):
    with pytest.raises(ValueError, match="outside .* vocabulary"):
        train_reward_model([Pair([1, 99_999], [2])], policy, tmp_path / "rm")


def test_the_command_line_trains_and_reports_bad_input(policy, tmp_path, capsys):
    pairs = write_pairs(taught_pairs(policy)[:6], tmp_path / "pairs.jsonl")
    out = tmp_path / "rm"
    assert main(["--pairs", str(pairs), "--base", policy, "--out", str(out), "--epochs", "1", "--held-out", "0"]) == 0
    assert (out / REPORT_FILE).exists() and "6 train / 0 held-out pairs" in capsys.readouterr().out
    missing = tmp_path / "nothing"
    assert main(["--pairs", str(pairs), "--base", str(missing), "--out", str(out)]) == 2
    assert f"base model {str(missing)!r}" in capsys.readouterr().err
