import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import AlgorithmConfig
from services.learner.advantages import ADVANTAGES, build_estimator
from services.learner.advantages.base import AdvantageEstimator, AdvantageInputs
from services.learner.advantages.gae import GAE, gae
from services.learner.advantages.grpo import GRPO
from services.learner.advantages.reinforce_pp import ReinforcePlusPlus, ReinforcePlusPlusBaseline
from services.learner.advantages.rloo import RLOO


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
@given(st.integers(1, 12), st.integers(1, 9), st.integers(1, 5), st.booleans(), st.integers(0, 2**31))
def test_grpo_matches_reference(batch, length, n_groups, norm, seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < 0.6).double()
    groups = torch.randint(0, n_groups, (batch,), generator=gen) * 7 + 3  # arbitrary ids
    got = GRPO(norm_adv_by_std=norm).compute(AdvantageInputs(rewards, mask, groups))
    torch.testing.assert_close(got, reference_grpo(rewards, mask, groups, norm))
    assert got.shape == (batch, length)


def test_group_of_one_and_equal_scores_give_zero():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 3.0], [0.0, 2.0], [0.0, 0.0]])
    mask = torch.ones(5, 2)
    adv = GRPO().compute(AdvantageInputs(rewards, mask, torch.tensor([0, 0, 1, 1, 2])))
    assert adv[:2].abs().max() == 0 and adv[4].abs().max() == 0
    assert adv[2, 0] > 0 > adv[3, 0]


def test_dr_grpo_is_mean_centred_only():
    rewards = torch.tensor([[2.0], [0.0], [1.0]])
    adv = GRPO(norm_adv_by_std=False).compute(AdvantageInputs(rewards, torch.ones(3, 1), torch.tensor([0, 0, 0])))
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-1.0], [0.0]]))


def test_registry_and_config():
    assert "grpo" in ADVANTAGES.names()
    est = build_estimator(AlgorithmConfig(norm_adv_by_std=False))
    assert isinstance(est, GRPO) and isinstance(est, AdvantageEstimator) and not est.norm_adv_by_std
    assert not est.needs_values
    with pytest.raises(ValueError, match="'nope' is not one of: gae, gigpo, grpo"):
        AlgorithmConfig(advantage="nope")
    with pytest.raises(KeyError):
        build_estimator(AlgorithmConfig.model_construct(advantage="nope"))


# -- RLOO, REINFORCE++, GAE against plain loops --------------------------------------------------------


def rand_batch(seed, batch, length, n_groups, p_mask=0.6):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < p_mask).double()
    groups = torch.randint(0, n_groups, (batch,), generator=gen) * 5 + 11
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    return rewards, mask, groups, values


def masked_positions(mask_row):
    return [t for t, m in enumerate(mask_row) if m]


def ref_scores(rewards, mask):
    return [sum(r * m for r, m in zip(rr, mm)) for rr, mm in zip(rewards.tolist(), mask.tolist())]


def ref_whiten(x, mask):
    vals = [v for row, mrow in zip(x, mask.tolist()) for v, m in zip(row, mrow) if m]
    if not vals:
        return [[0.0] * len(row) for row in x]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)
    return [
        [(v - mean) / math.sqrt(var + 1e-8) if m else 0.0 for v, m in zip(row, mrow)]
        for row, mrow in zip(x, mask.tolist())
    ]


def reference_rloo(rewards, mask, groups):
    scores, g = ref_scores(rewards, mask), groups.tolist()
    out = torch.zeros_like(rewards)
    for i in range(len(g)):
        others = [scores[j] for j in range(len(g)) if g[j] == g[i] and j != i]
        if others:
            out[i] = (scores[i] - sum(others) / len(others)) * mask[i]
    return out


def reference_returns(rewards, mask, gamma):
    out = []
    for rr, mm in zip(rewards.tolist(), mask.tolist()):
        row, running = [0.0] * len(rr), 0.0
        for t in reversed(masked_positions(mm)):
            running = rr[t] + gamma * running
            row[t] = running
        out.append(row)
    return out


def reference_gae(rewards, values, mask, gamma, lam):
    adv_out, ret_out = [], []
    for rr, vv, mm in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        adv, ret = [0.0] * len(rr), [0.0] * len(rr)
        idx = masked_positions(mm)
        next_adv = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = vv[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rr[t] + gamma * next_v - vv[t]
            next_adv = delta + gamma * lam * next_adv
            adv[t], ret[t] = next_adv, next_adv + vv[t]
        adv_out.append(adv)
        ret_out.append(ret)
    return torch.tensor(adv_out, dtype=torch.float64), torch.tensor(ret_out, dtype=torch.float64)


batches = st.tuples(st.integers(0, 2**31), st.integers(1, 10), st.integers(1, 9), st.integers(1, 4))


@settings(max_examples=80, deadline=None)
@given(batches)
def test_rloo_matches_reference(args):
    seed, batch, length, n_groups = args
    rewards, mask, groups, _ = rand_batch(seed, batch, length, n_groups)
    torch.testing.assert_close(
        RLOO().compute(AdvantageInputs(rewards, mask, groups)), reference_rloo(rewards, mask, groups)
    )


@settings(max_examples=80, deadline=None)
@given(batches, st.floats(0.0, 1.0))
def test_reinforce_pp_matches_reference(args, gamma):
    seed, batch, length, n_groups = args
    rewards, mask, groups, _ = rand_batch(seed, batch, length, n_groups)
    got = ReinforcePlusPlus().compute(AdvantageInputs(rewards, mask, groups, gamma=gamma))
    expected = torch.tensor(ref_whiten(reference_returns(rewards, mask, gamma), mask), dtype=torch.float64)
    torch.testing.assert_close(got, expected)


@settings(max_examples=80, deadline=None)
@given(batches)
def test_reinforce_pp_baseline_matches_reference(args):
    seed, batch, length, n_groups = args
    rewards, mask, groups, _ = rand_batch(seed, batch, length, n_groups)
    scores, g = ref_scores(rewards, mask), groups.tolist()
    centred = []
    for i in range(len(g)):
        members = [scores[j] for j in range(len(g)) if g[j] == g[i]]
        mean = sum(members) / len(members) if len(members) > 1 else 0.0
        centred.append([(scores[i] - mean) * m for m in mask[i].tolist()])
    expected = torch.tensor(ref_whiten(centred, mask), dtype=torch.float64)
    torch.testing.assert_close(ReinforcePlusPlusBaseline().compute(AdvantageInputs(rewards, mask, groups)), expected)


@settings(max_examples=80, deadline=None)
@given(batches, st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_matches_reference(args, gamma, lam):
    seed, batch, length, n_groups = args
    rewards, mask, groups, values = rand_batch(seed, batch, length, n_groups)
    adv, returns = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(returns, ref_ret)
    whitened, targets = GAE().advantages_and_returns(
        AdvantageInputs(rewards, mask, groups, values=values, gamma=gamma, lam=lam)
    )
    torch.testing.assert_close(whitened, torch.tensor(ref_whiten(ref_adv.tolist(), mask), dtype=torch.float64))
    torch.testing.assert_close(targets, ref_ret)


@settings(max_examples=60, deadline=None)
@given(batches, st.floats(0.0, 1.0))
def test_gae_lambda_zero_is_one_step_td_error(args, gamma):
    seed, batch, length, n_groups = args
    rewards, mask, _, values = rand_batch(seed, batch, length, n_groups)
    adv, _ = gae(rewards, values, mask, gamma, 0.0)
    td = torch.zeros_like(rewards)
    for b in range(batch):
        idx = masked_positions(mask[b].tolist())
        for k, t in enumerate(idx):
            next_v = values[b, idx[k + 1]] if k + 1 < len(idx) else 0.0
            td[b, t] = rewards[b, t] + gamma * next_v - values[b, t]
    torch.testing.assert_close(adv, td)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_gae_lambda_one_gamma_one_is_returns_minus_values(args):
    seed, batch, length, n_groups = args
    rewards, mask, _, values = rand_batch(seed, batch, length, n_groups)
    adv, returns = gae(rewards, values, mask, 1.0, 1.0)
    mc = torch.tensor(reference_returns(rewards, mask, 1.0), dtype=torch.float64)  # reward-to-go
    torch.testing.assert_close(adv, (mc - values) * mask)
    torch.testing.assert_close(returns, mc)


def test_gae_skips_observation_tokens_between_turns():
    # prompt, turn 1 (2 tokens), observation (2 tokens), turn 2 (1 token): token 3's successor is token 6
    mask = torch.tensor([[0, 1, 1, 0, 0, 1.0]])
    rewards = torch.tensor([[0, 0, 0, 0, 0, 1.0]])
    values = torch.tensor([[9, 0.5, 0.25, 9, 9, 0.75]])
    adv, _ = gae(rewards, values, mask, gamma=0.5, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.5 * 0.25 - 0.5, 0.5 * 0.75 - 0.25, 0, 0, 1 - 0.75]]))


def test_gae_needs_values_and_every_estimator_is_registered():
    assert set(ADVANTAGES.names()) >= {"grpo", "rloo", "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}
    for name in ADVANTAGES.names():
        est = build_estimator(AlgorithmConfig(advantage=name))
        assert est.name == name and est.needs_values == (name == "gae")
    with pytest.raises(ValueError, match="values"):
        GAE().compute(AdvantageInputs(torch.zeros(1, 2), torch.ones(1, 2), torch.zeros(1)))


def test_rloo_worked_example():
    rewards = torch.tensor([[1.0], [0.0], [0.0], [5.0]])
    adv = RLOO().compute(AdvantageInputs(rewards, torch.ones(4, 1), torch.tensor([0, 0, 0, 1])))
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-0.5], [-0.5], [0.0]]))
