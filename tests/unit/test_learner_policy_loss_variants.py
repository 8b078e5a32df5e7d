"""GSPO, CISPO and the loss aggregation modes against plain float64 loops over sequences and tokens: the loss,
its gradient with respect to every logprob (the gradient is what these losses change), the stats, and
micro-batches that add up to the full batch with the mini-batch's divisors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import AlgorithmConfig
from services.learner.losses import AGG_MODES, aggregate
from services.learner.policy_losses import POLICY_LOSSES, build_policy_loss
from services.learner.policy_losses.base import POLICY_STATS, PolicyLossInputs
from services.learner.policy_losses.cispo import CISPO
from services.learner.policy_losses.gspo import GSPO


def rand_inputs(seed, batch, length, spread=0.3, p_mask=0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    lp = old + torch.randn(batch, length, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < p_mask).double()
    weights = torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2
    return lp, old, adv, mask, weights


def positions(row):
    return [t for t, m in enumerate(row) if m]


def agg_weight(mask, mode, b, scale=None):
    """d loss / d (token loss of a masked token of row b) under verl's agg_loss."""
    n_tokens = max(sum(sum(row) for row in mask), 1)
    n_seqs = max(sum(1 for row in mask if any(row)), 1)
    if mode == "token-mean":
        return 1 / n_tokens
    if mode == "token-sum":
        return 1.0
    if mode == "seq-mean-token-sum":
        return 1 / n_seqs
    if mode == "seq-mean-token-mean":
        return 1 / (n_seqs * sum(mask[b]))
    return 1 / (n_seqs * (len(mask[b]) if scale is None else scale))


def reference_loss(lp, old, adv, mask, weights, mode, token_fn):
    """`token_fn(b, t, row ratio info)` -> (token loss, d token loss / d lp[b][t], ratio, clipped).
    Returns (loss, gradient [B][T], stats)."""
    lp, old, adv, mask, weights = (x.tolist() for x in (lp, old, adv, mask, weights))
    loss, grad = 0.0, [[0.0] * len(row) for row in lp]
    n, clipped, kl, k1, ratios = 0, 0, 0.0, 0.0, 0.0
    for b in range(len(lp)):
        for t in positions(mask[b]):
            value, dvalue, ratio, was_clipped = token_fn(lp, old, adv, mask, b, t)
            w = agg_weight(mask, mode, b) * weights[b][t]
            loss += value * w
            grad[b][t] = dvalue * w
            r = math.exp(lp[b][t] - old[b][t])
            n, clipped, ratios = n + 1, clipped + was_clipped, ratios + ratio
            kl, k1 = kl + r - 1 - math.log(r), k1 + old[b][t] - lp[b][t]
    n = max(n, 1)
    stats = {"clip_frac": clipped / n, "clip_frac_lower": 0.0, "approx_kl": kl / n, "ppo_kl": k1 / n}
    return loss, grad, {**stats, "ratio_mean": ratios / n}


def gspo_token(lo, hi):
    def token(lp, old, adv, mask, b, t):
        idx = positions(mask[b])
        s = math.exp(min(sum(lp[b][u] - old[b][u] for u in idx) / len(idx), 10.0))
        a = adv[b][t]
        unclipped, clipped = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        # d s_i,t / d log p_t = s_i; the clipped branch is flat where it is the larger one
        return max(unclipped, clipped), (-a * s if unclipped >= clipped else 0.0), s, clipped > unclipped

    return token


def cispo_token(lo, hi):
    def token(lp, old, adv, mask, b, t):
        r = math.exp(lp[b][t] - old[b][t])
        w = min(max(r, 1 - lo), 1 + hi)
        a = adv[b][t]
        # the clipped ratio is a constant: every token keeps the REINFORCE gradient, scaled
        return -w * a * lp[b][t], -w * a, r, not (1 - lo <= r <= 1 + hi)

    return token


CASES = {"gspo": (GSPO, gspo_token), "cispo": (CISPO, cispo_token)}


def run_loss(loss_cls, lp, old, adv, mask, weights, mode, lo, hi):
    lp = lp.clone().requires_grad_(True)
    loss, stats = loss_cls(clip_low=lo, clip_high=hi, agg_mode=mode)(
        PolicyLossInputs(lp, old, adv, mask, is_weights=weights)
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad, stats


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(sorted(CASES)),
    st.integers(0, 2**31),
    st.integers(1, 6),
    st.integers(1, 8),
    st.sampled_from(AGG_MODES),
    st.floats(0.0, 0.5),
    st.floats(0.0, 1.0),
    st.sampled_from([0.05, 0.3, 1.0]),
)
def test_loss_gradient_and_stats_match_reference(name, seed, batch, length, mode, lo, hi, spread):
    loss_cls, token_fn = CASES[name]
    lp, old, adv, mask, weights = rand_inputs(seed, batch, length, spread)
    loss, grad, stats = run_loss(loss_cls, lp, old, adv, mask, weights, mode, lo, hi)
    ref_loss, ref_grad, ref_stats = reference_loss(lp, old, adv, mask, weights, mode, token_fn(lo, hi))
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert set(stats) == set(POLICY_STATS)
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_gspo_clips_the_whole_sequence_by_its_geometric_mean_ratio():
    """Row 0's tokens each stay within the band, but their mean log-ratio leaves it: no gradient for A > 0.
    Row 1's tokens leave the band one by one and average to ratio 1: every token keeps its gradient."""
    old = torch.zeros(2, 3, dtype=torch.float64)
    lp = torch.tensor([[0.15, 0.15, 0.15], [0.5, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    adv, mask = torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)
    loss, stats = GSPO(clip_low=0.1, clip_high=0.1, agg_mode="seq-mean-token-mean")(
        PolicyLossInputs(lp, old, adv, mask)
    )
    loss.backward()
    assert lp.grad[0].abs().max() == 0  # e^0.15 = 1.16 > 1.1, the sequence is clipped
    torch.testing.assert_close(lp.grad[1], torch.full((3,), -1 / 6, dtype=torch.float64))  # -A s / (G |y|), s = 1
    assert loss.item() == pytest.approx((-1.1 - 1.0) / 2)
    assert stats["clip_frac"].item() == 0.5 and stats["ratio_mean"].item() == pytest.approx((math.exp(0.15) + 1) / 2)


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips():
    old = torch.zeros(1, 3, dtype=torch.float64)
    lp = torch.tensor([[1.0, -1.0, 0.05]], dtype=torch.float64, requires_grad=True)  # ratios e, 1/e, 1.05
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, stats = CISPO(clip_low=0.2, clip_high=0.28, agg_mode="token-sum")(
        PolicyLossInputs(lp, old, adv, torch.ones(1, 3, dtype=torch.float64))
    )
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28, 0.8, -2 * math.exp(0.05)]], dtype=torch.float64))
    assert stats["clip_frac"].item() == pytest.approx(2 / 3)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_the_mini_batch_divisors_add_up(name, mode):
    lp, old, adv, mask, weights = rand_inputs(4, 7, 9)
    mask[3] = 0
    lp.requires_grad_(True)
    loss_fn = build_policy_loss(AlgorithmConfig(policy_loss=name, loss_agg_mode=mode, clip_ratio_high=0.28))
    divisors = {"num_tokens": mask.sum().item(), "num_seqs": (mask.sum(-1) > 0).sum().item(), "loss_scale_factor": 9.0}
    full, _ = loss_fn(PolicyLossInputs(lp, old, adv, mask, is_weights=weights))
    (g_full,) = torch.autograd.grad(full, lp)
    parts = [
        loss_fn(PolicyLossInputs(lp[s], old[s], adv[s], mask[s], is_weights=weights[s], **divisors))[0]
        for s in (slice(0, 2), slice(2, 5), slice(5, 7))
    ]
    (g_parts,) = torch.autograd.grad(sum(parts), lp)
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_parts, g_full)


def test_losses_are_registered_and_built_from_the_config():
    assert {"ppo_clip", "gspo", "cispo"} <= set(POLICY_LOSSES.names())
    for name, cls in (("gspo", GSPO), ("cispo", CISPO)):
        config = AlgorithmConfig(policy_loss=name, clip_ratio_low=3e-4, clip_ratio_high=4e-4, loss_agg_mode="token-sum")
        loss = build_policy_loss(config)
        assert type(loss) is cls and loss.name == name
        assert (loss.clip_low, loss.clip_high, loss.agg_mode) == (3e-4, 4e-4, "token-sum")


# -- the aggregation modes ---------------------------------------------------------------------------


def test_token_sum_and_seq_mean_token_sum_norm_worked_example():
    """verl 0.9.1's agg_loss: token-sum has no divisor; seq-mean-token-sum-norm divides the sum of the
    sequences' token sums by (sequences * loss_scale_factor), the factor defaulting to the width T."""
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    assert aggregate(loss, mask, "token-sum").item() == 24.0
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == 24.0 / (2 * 4)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=6.0).item() == 24.0 / (2 * 6)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", num_seqs=4.0, loss_scale_factor=6.0).item() == 1.0
    assert aggregate(loss, mask, "token-sum", num_tokens=99.0, num_seqs=7.0).item() == 24.0  # no divisor


def test_config_accepts_the_new_modes_and_a_scale_factor():
    config = AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=512)
    assert config.loss_scale_factor == 512.0 and AlgorithmConfig().loss_scale_factor == 0.0
    assert AlgorithmConfig(loss_agg_mode="token-sum").loss_agg_mode == "token-sum"
    with pytest.raises(ValueError):
        AlgorithmConfig(loss_agg_mode="seq-sum")
