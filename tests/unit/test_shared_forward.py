"""Prefix-shared reward-model passes (services.reward.shared_forward): each input's score equals the plain forward
of that input alone, whatever the inputs share, while shared prompts and repeats are computed once."""

import random

import pytest

from services.reward.reward_model import RewardModel, load_classifier, shared_forward
from services.reward.shared_forward import Plan, pool_position
from tests.support.reward_models import agent_like_rows, build_tiny_policy, build_tiny_reward_model

PAD = 0  # the tiny tokenizer's


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    path = build_tiny_reward_model(root / "rm", build_tiny_policy(root / "policy"))
    tokenizer, model = load_classifier(str(path), "float32", "cpu")
    return str(path), model


def alone(model, row):
    import torch

    with torch.inference_mode():
        return model(input_ids=torch.tensor([row])).logits[0, 0].item()


def shared_scores(model, rows, min_shared_tokens):
    import torch

    plan = Plan.of(rows, model.config.pad_token_id)
    runner = shared_forward(model, model.config.pad_token_id, "cpu", min_shared_tokens)
    with torch.inference_mode():
        hidden, computed = runner.run(plan)
        scores = model.score(torch.stack([hidden[read] for read in plan.reads]))[:, 0].tolist()
    return scores, computed


def test_a_plan_runs_each_distinct_row_once_and_reads_a_prefix_off_its_extension():
    plan = Plan.of([[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 4], [5], [6, PAD, PAD]], PAD)
    assert plan.carriers == [(1, 2, 3), (1, 2, 4), (5,), (6, PAD, PAD)]
    assert plan.reads == [(0, 2), (0, 2), (0, 1), (1, 2), (2, 0), (3, 0)]
    assert pool_position([PAD, PAD], PAD) == 0 and pool_position([PAD, 7, PAD], PAD) == 1
    with pytest.raises(ValueError, match="no tokens"):
        Plan.of([[1], []], PAD)


@pytest.mark.parametrize("min_shared_tokens", [1, 16, 10**6])
def test_each_score_equals_the_plain_forward_of_its_row_alone(classifier, min_shared_tokens):
    _, model = classifier
    rows = agent_like_rows(model.config.vocab_size)
    expected = [alone(model, row) for row in rows]
    scores, _ = shared_scores(model, rows, min_shared_tokens)
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 5) for s in expected}) > 6  # the rows differ, and so do their scores


def test_a_groups_prompt_and_repeats_are_computed_once(classifier):
    _, model = classifier
    rng = random.Random(1)
    prompt = [rng.randrange(1, 300) for _ in range(60)]
    rows = [prompt + [10 + i] + [rng.randrange(1, 300) for _ in range(19)] for i in range(8)]
    scores, computed = shared_scores(model, rows + rows[:3], min_shared_tokens=128)
    assert computed == 60 + 8 * 20  # the prompt once, then each episode's own 20 tokens; 880 given
    assert Plan.of(rows + rows[:3], PAD).reads[8:] == [(0, 79), (1, 79), (2, 79)]  # a repeat reads its first's pass
    assert scores[8:] == pytest.approx(scores[:3], abs=1e-6)
    _, unshared = shared_scores(model, rows, min_shared_tokens=10**6)
    assert unshared == 8 * 80


def test_the_component_scores_alike_with_and_without_sharing(classifier):
    path, model = classifier
    rows = agent_like_rows(model.config.vocab_size, seed=2)
    shared = RewardModel(path, max_wait_ms=0, min_shared_tokens=1)
    plain = RewardModel(path, max_wait_ms=0, share_prefixes=False)
    assert shared.shared is not None and plain.shared is None
    assert shared._forward(rows) == pytest.approx(plain._forward(rows), abs=1e-5)
    with pytest.raises(ValueError, match="share_prefixes must be true or false"):
        RewardModel(path, share_prefixes="yes")
    with pytest.raises(ValueError, match="min_shared_tokens must be an int >= 1"):
        RewardModel(path, min_shared_tokens=0)


def test_a_process_reward_models_turns_run_as_one_episode(classifier):
    _, model = classifier
    rng = random.Random(3)
    episode = [rng.randrange(1, 300) for _ in range(90)]
    turn_ends = [30, 47, 70, 90]
    rows = [episode[:end] for end in turn_ends]
    plan = Plan.of(rows, PAD)
    assert plan.carriers == [tuple(episode)] and [at for at, _ in plan.reads] == [0, 0, 0, 0]
    scores, computed = shared_scores(model, rows, min_shared_tokens=32)
    assert computed == 90  # against 237 for the four turns each from the start
    assert scores == pytest.approx([alone(model, row) for row in rows], abs=1e-5)
