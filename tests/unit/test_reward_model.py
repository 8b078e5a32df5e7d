"""The `reward_model` component on a tiny one-label Llama classifier: the scores of a batch are each episode's own,
concurrent Score calls share forward passes, and a model that cannot serve fails at construction, by name."""

import threading
import time

import pytest

from services.common.tiny_model import build_tiny_model
from services.reward.batcher import Batcher
from services.reward.composer import RewardComposer
from services.reward.reward_model import RewardModel
from tests.support.reward_models import CORPUS, build_tiny_reward_model
from tests.support.trajectories import chat_episode


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    policy = build_tiny_model(root / "policy", CORPUS)
    rm, two = build_tiny_reward_model(root / "rm", policy), build_tiny_reward_model(root / "two", policy, num_labels=2)
    return str(policy), str(rm), str(two)


def episodes(policy, count=6):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    replies = ["<action>left</action>", "<action>right</action>", "go left", "<action>right</action> right"]
    return [chat_episode(tok, CORPUS[0], replies[: 1 + i % 3] + [replies[i % 4]], tid=f"t{i}") for i in range(count)]


def test_a_batch_scores_each_episode_as_it_scores_alone(models):
    policy, path, _ = models
    rm = RewardModel(path, max_wait_ms=0)
    trajs = episodes(policy)
    alone = [rm(t) for t in trajs]
    together = rm.score_batch(trajs)
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 6) for s in alone)) > 1  # the episodes differ, and so do their scores


def test_text_input_renders_the_conversation_under_the_reward_models_template(models):
    policy, path, _ = models
    by_text = RewardModel(path, input="text", policy_tokenizer=policy, max_wait_ms=0)
    trajs = episodes(policy, 3)
    rendered = by_text.input_ids(trajs[2])
    text = by_text.tokenizer.decode(rendered)
    turns = [t.text for t in trajs[2].turns]
    assert text.startswith("<|user|>" + CORPUS[0]) and text.count("The wall is near.") == len(turns) - 1
    assert text.split("<|assistant|>")[1:] == [
        f"{reply}<|end|>" + ("<|user|>The wall is near.<|end|>" if i < 3 else "") for i, reply in enumerate(turns)
    ]
    assert all(isinstance(s, float) for s in by_text.score_batch(trajs))


def test_concurrent_calls_share_a_forward_pass(models):
    policy, path, _ = models
    rm = RewardModel(path, max_batch=64, max_wait_ms=300)
    forwards = []
    run = rm.batcher.run
    rm.batcher.run = lambda batch: forwards.append(len(batch)) or run(batch)
    trajs, out = episodes(policy, 8), {}
    callers = [
        threading.Thread(target=lambda i=i: out.update({i: rm.score_batch(trajs[2 * i : 2 * i + 2])})) for i in range(4)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert sorted(forwards, reverse=True)[0] >= 4 and sum(forwards) == 8  # at least two calls' episodes in one pass
    alone = RewardModel(path, max_wait_ms=0).score_batch(trajs)
    assert [s for i in range(4) for s in out[i]] == pytest.approx(alone, abs=1e-5)


def test_the_batcher_never_exceeds_max_batch_and_a_failure_reaches_every_caller_of_its_batch():
    sizes = []

    def run(items):
        sizes.append(len(items))
        if "boom" in items:
            raise RuntimeError("model failed")
        return [x.upper() for x in items]

    batcher = Batcher(run, max_batch=3, max_wait_s=0.05)
    assert batcher.submit(["a", "b", "c", "d", "e"]) == ["A", "B", "C", "D", "E"]  # one call, in slices of 3
    with pytest.raises(RuntimeError, match="model failed"):
        batcher.submit(["x", "boom"])
    assert batcher.submit(["z"]) == ["Z"]  # the worker goes on after a failed batch
    assert max(sizes) <= 3


def test_the_wait_for_company_is_bounded():
    batcher = Batcher(lambda items: items, max_batch=100, max_wait_s=0.05)
    start = time.monotonic()
    assert batcher.submit([1]) == [1]
    assert time.monotonic() - start < 2.0


def test_a_reward_model_that_cannot_serve_fails_at_construction_naming_it(models, tmp_path):
    _, path, two_labels = models
    with pytest.raises(ValueError, match="reward model '/nonexistent/rm': no such folder"):
        RewardModel("/nonexistent/rm")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="a folder without a model"):
        RewardModel(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="has 2 labels"):
        RewardModel(two_labels)
    with pytest.raises(ValueError, match="set policy_tokenizer"):
        RewardModel(path, input="text")
    with pytest.raises(ValueError, match="reward component 'reward_model': bad params"):
        RewardComposer({"reward_model": {"params": {"path": "/nonexistent/rm"}}})


def test_a_token_outside_the_models_vocabulary_fails_that_batch_with_a_clear_error(models):
    policy, path, _ = models
    rm = RewardModel(path, max_wait_ms=0)
    bad = episodes(policy, 1)[0]
    bad.token_ids[-1] = 10_000
    composer = RewardComposer({"reward_model": {"params": {"path": path, "max_wait_ms": 0}}})
    with pytest.raises(RuntimeError, match="outside the reward model's vocabulary"):
        composer.score_many([bad])
    assert isinstance(rm(episodes(policy, 1)[0]), float)


def test_per_turn_scores_each_turn_by_the_episode_up_to_its_end(models):
    policy, path, _ = models
    prm, whole = RewardModel(path, per_turn=True, max_wait_ms=0), RewardModel(path, max_wait_ms=0)
    trajs = episodes(policy, 4)
    scores = prm.score_turns_batch(trajs)
    assert [len(s) for s in scores] == [len(t.turns) for t in trajs]
    for traj, turn_scores in zip(trajs, scores):
        ends = [t.start + t.model_tokens for t in traj.turns]
        assert [prm.input_ids(traj, turns=k + 1) for k in range(len(ends))] == [list(traj.token_ids[:e]) for e in ends]
        assert turn_scores[-1] == pytest.approx(whole(traj), abs=1e-5)  # the last turn's prefix is the whole episode
        assert prm(traj) == pytest.approx(sum(turn_scores), abs=1e-5)
    by_text = RewardModel(path, input="text", policy_tokenizer=policy, per_turn=True, max_wait_ms=0)
    first = by_text.tokenizer.decode(by_text.input_ids(trajs[2], turns=1))
    assert first.count("<|assistant|>") == 1 and "The wall is near." not in first
