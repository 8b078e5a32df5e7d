"""`algorithm.singleton_group_advantage`: a GRPO/RLOO group of one gets 0 (`zero`, the default, TRL) or its raw
score (`score`, verl 0.9.1: GRPO's mean 0 and std 1 for such a group, RLOO's score left as it is), checked
against plain loops on batches where some groups have one member."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import AlgorithmConfig
from services.learner.advantages import build_estimator
from services.learner.advantages.base import AdvantageInputs
from services.learner.advantages.grpo import GRPO
from services.learner.advantages.rloo import RLOO

EPS = 1e-6


def scores_of(rewards, mask):
    return [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards.tolist(), mask.tolist())]


def reference(rewards, mask, groups, estimator, norm, singleton):
    """verl's compute_grpo_outcome_advantage / compute_rloo_outcome_advantage, one trajectory at a time."""
    scores, g = scores_of(rewards, mask), groups.tolist()
    out = torch.zeros_like(rewards)
    for i in range(len(g)):
        members = [scores[j] for j in range(len(g)) if g[j] == g[i]]
        if len(members) == 1:
            adv = 0.0 if singleton == "zero" else (scores[i] / (1 + EPS) if estimator == "grpo" and norm else scores[i])
        elif estimator == "rloo":
            adv = scores[i] - (sum(members) - scores[i]) / (len(members) - 1)
        else:
            mean = sum(members) / len(members)
            adv = scores[i] - mean
            if norm:
                adv /= math.sqrt(sum((s - mean) ** 2 for s in members) / (len(members) - 1)) + EPS
        out[i] = adv * mask[i]
    return out


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 2**31),
    st.integers(1, 10),
    st.integers(1, 6),
    st.sampled_from(["grpo", "rloo"]),
    st.booleans(),
    st.sampled_from(["zero", "score"]),
)
def test_matches_reference_with_groups_of_one(seed, batch, length, estimator, norm, singleton):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.7).double()
    groups = torch.randint(0, batch, (batch,), generator=gen)  # as many ids as rows: many groups of one
    est = GRPO(norm_adv_by_std=norm, singleton=singleton) if estimator == "grpo" else RLOO(singleton=singleton)
    got = est.compute(AdvantageInputs(rewards, mask, groups))
    torch.testing.assert_close(got, reference(rewards, mask, groups, estimator, norm, singleton))


def test_worked_example_and_the_config():
    rewards = torch.tensor([[0.0, 2.0], [1.0, 0.0], [3.0, 0.0]])
    mask, groups = torch.ones(3, 2), torch.tensor([0, 0, 1])
    inputs = AdvantageInputs(rewards, mask, groups)
    for name in ("grpo", "rloo"):
        zero = build_estimator(AlgorithmConfig(advantage=name)).compute(inputs)
        score = build_estimator(AlgorithmConfig(advantage=name, singleton_group_advantage="score")).compute(inputs)
        assert zero[2].abs().max() == 0 and torch.equal(zero[:2], score[:2])
        expected = 3.0 / (1 + EPS) if name == "grpo" else 3.0
        assert score[2].tolist() == pytest.approx([expected, expected])
    dr = GRPO(norm_adv_by_std=False, singleton="score").compute(inputs)
    assert dr[2].tolist() == [3.0, 3.0]
    assert AlgorithmConfig().singleton_group_advantage == "zero"
    with pytest.raises(ValueError):
        AlgorithmConfig(singleton_group_advantage="raw")
