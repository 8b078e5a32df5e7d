"""The in-process learning loop that compares GiGPO with GRPO (tests/support/inprocess_rl.py, bench/gigpo_vs_grpo.py)
is deterministic: one process, no services, the real learner, corridor env, prompt format, action parser and reward
functions, the policy sampled with torch from the learner's own weights after every step; the same seed twice gives
the same curves, to the last bit of the mean reward.

There is no margin test of GiGPO over GRPO yet: at the budgets a CI test affords (tens of steps of 32 episodes),
neither led on every seed (docs/algorithms.md, GiGPO, "Seen"), so a margin would not hold on every run."""

import pytest

from tests.support.inprocess_rl import race_config, train

pytestmark = pytest.mark.slow

TASK = ("corridor", "{length: 12, distance: 5, max_turns: 11}")
STEPS = 2


def test_the_same_seed_gives_the_same_curves(learning_tiny_model):
    runs = [train(race_config(*TASK, "gigpo", seed=0, steps=STEPS), learning_tiny_model) for _ in range(2)]
    assert runs[0].success == runs[1].success and runs[0].reward == runs[1].reward
    assert len(runs[0].success) == STEPS and 0 < max(runs[0].success) < 1  # episodes were played, some won
