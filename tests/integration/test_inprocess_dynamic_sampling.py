"""Dynamic sampling and held-out validation in the deterministic in-process loop (tests/support/inprocess_rl.py), on
corridor with mixed distances (a third of the tasks out of reach, so their groups all fail), rewarded by the goal
alone (a reply that does not parse would tell the members of a group apart by their `format` reward):

- with dynamic sampling every trained group carries advantage, each step trains `groups_per_step` groups of
  distinct ids, and the episodes counted are the kept and the dropped groups';
- validation plays every held-out task (the validation split) once per due policy version;
- a step that cannot fill its groups within `dynamic_sampling_max_gen_batches` fails with the learner's
  `DynamicSamplingExhausted`;
- without it, the curve counts the uniform groups it trained on and drops none."""

import pytest

from services.learner.service import DynamicSamplingExhausted, by_group, same_reward
from services.learner.trainer import PolicyTrainer
from tests.support.inprocess_rl import race_config, train

MIXED = "{length: 8, distances: [1, 3, 5], max_turns: 3}"
SMALL = ["rollout.groups_per_step=4", "rollout.group_size=4", "reward.components={goal: {weight: 1.0}}"]
STILL = ["algorithm.lr=1.0e-5"]
"""Keeps the policy near the start, whose groups are often mixed: at the loop's own lr (1.5e-3) step 2 found 3
informative groups in 40 and failed."""
VALIDATION = ["env.validation_every=1", "env.validation_tasks=12"]


@pytest.fixture
def trained_batches(monkeypatch) -> list[list]:
    batches: list[list] = []
    real = PolicyTrainer.train_step

    def record(trainer, trajectories):
        batches.append(list(trajectories))
        return real(trainer, trajectories)

    monkeypatch.setattr(PolicyTrainer, "train_step", record)
    return batches


def test_dynamic_sampling_trains_informative_groups_only(learning_tiny_model, trained_batches):
    overrides = [*SMALL, *STILL, *VALIDATION, "algorithm.dynamic_sampling=true"]
    config = race_config("corridor", MIXED, "grpo", seed=0, steps=2, overrides=overrides)
    curve = train(config, learning_tiny_model)
    for batch, episodes, dropped in zip(trained_batches, curve.episodes, curve.dropped, strict=True):
        groups = by_group(batch)
        assert len(groups) == 4 and all(len(members) == 4 for members in groups)
        assert not any(same_reward(members) for members in groups)
        assert episodes == (4 + dropped) * 4
    assert curve.uniform == [0, 0] and sum(curve.dropped) > 0
    assert curve.held_out == list(range(config.env.train_tasks, config.env.train_tasks + 12))
    assert sorted(curve.validation) == [0, 1, 2] and all(len(won) == 12 for won in curve.validation.values())
    out_of_reach = [i for i, task in enumerate(curve.held_out) if task % 3 == 2]
    assert not any(curve.validation[v][i] for v in curve.validation for i in out_of_reach)


def test_a_step_that_cannot_fill_its_groups_fails(learning_tiny_model):
    overrides = [*SMALL, "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_gen_batches=2"]
    config = race_config("corridor", "{length: 8, distances: [5], max_turns: 3}", "grpo", 0, 1, overrides)
    with pytest.raises(DynamicSamplingExhausted, match="dynamic_sampling_max_gen_batches=2"):
        train(config, learning_tiny_model)


def test_without_dynamic_sampling_uniform_groups_are_trained(learning_tiny_model, trained_batches):
    config = race_config("corridor", MIXED, "grpo", seed=0, steps=2, overrides=SMALL)
    curve = train(config, learning_tiny_model)
    assert curve.dropped == [0, 0] and curve.episodes == [16, 16] and not curve.validation
    assert curve.uniform == [sum(same_reward(m) for m in by_group(batch)) for batch in trained_batches]
    assert sum(curve.uniform) > 0  # the out-of-reach tasks' groups at least
