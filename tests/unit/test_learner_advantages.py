import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES, build_estimator
from services.learner.advantages.base import AdvantageEstimator
from services.learner.advantages.grpo import GRPO


def reference_grpo(token_rewards, mask, groups, norm_by_std, eps=1e-6):
    scores = [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(token_rewards.tolist(), mask.tolist())]
    out = torch.zeros_like(token_rewards)
    for i, g in enumerate(groups.tolist()):
        members = [scores[j] for j, h in enumerate(groups.tolist()) if h == g]
        if len(members) < 2:
            continue
        mean = sum(members) / len(members)
        adv = scores[i] - mean
        if norm_by_std:
            std = math.sqrt(sum((s - mean) ** 2 for s in members) / (len(members) - 1))
            adv /= std + eps
        out[i] = adv * mask[i]
    return out


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.integers(1, 9), st.integers(1, 5), st.booleans(), st.integers(0, 2 ** 31))
def test_grpo_matches_reference(batch, length, n_groups, norm, seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.6).double()
    groups = torch.randint(0, n_groups, (batch,), generator=gen) * 7 + 3  # arbitrary ids
    got = GRPO(norm_adv_by_std=norm).compute(rewards, mask, groups)
    torch.testing.assert_close(got, reference_grpo(rewards, mask, groups, norm))
    assert got.shape == (batch, length)


def test_group_of_one_and_equal_scores_give_zero():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 3.0], [0.0, 2.0], [0.0, 0.0]])
    mask = torch.ones(5, 2)
    adv = GRPO().compute(rewards, mask, torch.tensor([0, 0, 1, 1, 2]))
    assert adv[:2].abs().max() == 0 and adv[4].abs().max() == 0
    assert adv[2, 0] > 0 > adv[3, 0]


def test_dr_grpo_is_mean_centred_only():
    rewards = torch.tensor([[2.0], [0.0], [1.0]])
    adv = GRPO(norm_adv_by_std=False).compute(rewards, torch.ones(3, 1), torch.tensor([0, 0, 0]))
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-1.0], [0.0]]))


def test_registry_and_config():
    assert "grpo" in ADVANTAGES.names()
    est = build_estimator(AlgorithmConfig(norm_adv_by_std=False))
    assert isinstance(est, GRPO) and isinstance(est, AdvantageEstimator) and not est.norm_adv_by_std
    assert not est.needs_values
    with pytest.raises(KeyError):
        build_estimator(AlgorithmConfig(advantage="nope"))
