import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.learner.losses import (
    AGG_MODES,
    aggregate,
    masked_mean,
    mismatch_kl,
    policy_loss,
    truncated_is_weights,
    value_loss,
)


def reference_agg(per_seq, mode, width, scale=None):
    """verl's agg_loss over per-sequence lists of token losses (empty sequences count in no mode)."""
    tokens = [x for s_ in per_seq for x in s_]
    nonempty = [s_ for s_ in per_seq if s_]
    n_seq = max(len(nonempty), 1)
    return {
        "token-mean": sum(tokens) / max(len(tokens), 1),
        "token-sum": sum(tokens),
        "seq-mean-token-sum": sum(sum(s_) for s_ in nonempty) / n_seq,
        "seq-mean-token-mean": sum(sum(s_) / len(s_) for s_ in nonempty) / n_seq,
        "seq-mean-token-sum-norm": sum(sum(s_) for s_ in nonempty) / n_seq / (width if scale is None else scale),
    }[mode]


def reference(lp, old, adv, mask, lo, hi, mode, dual_c=None, weights=None):
    """Token by token, in plain Python."""
    lp, old, adv, mask = (x.tolist() for x in (lp, old, adv, mask))
    weights = weights.tolist() if weights is not None else [[1.0] * len(row) for row in lp]
    per_seq, tokens, clipped, lower, kl, ratios, k1 = [], [], 0, 0, 0.0, 0.0, 0.0
    for b in range(len(lp)):
        seq = []
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            r = math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            u, c = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            loss = max(u, c)
            if dual_c is not None and a < 0 and loss > -a * dual_c:
                loss, lower = -a * dual_c, lower + 1
            seq.append(loss * weights[b][t])
            clipped += c > u
            kl += r - 1 - math.log(r)
            k1 += old[b][t] - lp[b][t]
            ratios += r
        per_seq.append(seq)
        tokens += seq
    loss = reference_agg(per_seq, mode, len(lp[0]))
    n = max(len(tokens), 1)
    return loss, {
        "clip_frac": clipped / n,
        "clip_frac_lower": lower / n,
        "approx_kl": kl / n,
        "ppo_kl": k1 / n,
        "ratio_mean": ratios / n,
    }


def rand_inputs(seed, batch, length, p_mask=0.6, spread=0.3):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    lp = old + torch.randn(batch, length, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < p_mask).double()
    return lp, old, adv, mask


@settings(max_examples=100, deadline=None)
@given(
    st.integers(0, 2**31),
    st.integers(1, 6),
    st.integers(1, 8),
    st.sampled_from(AGG_MODES),
    st.floats(0.0, 0.5),
    st.floats(0.0, 2.0),
    st.one_of(st.none(), st.floats(1.01, 4.0)),
    st.booleans(),
    st.sampled_from([0.3, 1.5]),
)
def test_policy_loss_matches_reference(seed, batch, length, mode, lo, hi, dual_c, weighted, spread):
    lp, old, adv, mask = rand_inputs(seed, batch, length, spread=spread)  # spread 1.5: ratios beyond the dual clip
    weights = torch.rand(batch, length, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 2
    weights = weights if weighted else None
    loss, stats = policy_loss(lp, old, adv, mask, lo, hi, mode, clip_ratio_c=dual_c, is_weights=weights)
    ref_loss, ref_stats = reference(lp, old, adv, mask, lo, hi, mode, dual_c, weights)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_dual_clip_caps_negative_advantage_losses_and_stops_their_gradient():
    old = torch.zeros(1, 3)
    lp = torch.tensor([[2.0, 2.0, 0.5]], requires_grad=True)  # ratios e^2 ~ 7.4 (beyond c = 3) and e^0.5
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    loss, stats = policy_loss(lp, old, adv, torch.ones(1, 3), 0.2, 0.2, "seq-mean-token-sum", clip_ratio_c=3.0)
    loss.backward()
    # token 0: A < 0, capped at -A * c = 3 (no gradient); token 1: A > 0, clipped at 1.2 (no gradient);
    # token 2: A < 0, ratio 1.65 below c, unclipped branch -A * r keeps its gradient
    assert loss.item() == pytest.approx(3.0 - 1.2 + math.exp(0.5))
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == 0 and lp.grad[0, 2] == pytest.approx(math.exp(0.5))
    assert stats["clip_frac_lower"].item() == pytest.approx(1 / 3)
    unbounded, _ = policy_loss(lp.detach(), old, adv, torch.ones(1, 3), 0.2, 0.2, "seq-mean-token-sum")
    assert unbounded.item() == pytest.approx(math.exp(2.0) - 1.2 + math.exp(0.5))


def test_truncated_is_weights():
    old = torch.tensor([[-1.0, -1.0, -3.0]])
    rollout = torch.tensor([[-1.0, -2.0, -1.0]])
    w = truncated_is_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, math.exp(-2.0)]]))  # e^1 > 2 is truncated
    assert not w.requires_grad


def reference_value_loss(v, old, ret, mask, clip, mode):
    v, old, ret, mask = (x.tolist() for x in (v, old, ret, mask))
    per_seq, clipped_count, n = [], 0, 0
    for b in range(len(v)):
        seq = []
        for t in range(len(v[b])):
            if not mask[b][t]:
                continue
            vc = old[b][t] + min(max(v[b][t] - old[b][t], -clip), clip)
            plain, clipped = (v[b][t] - ret[b][t]) ** 2, (vc - ret[b][t]) ** 2
            seq.append(max(plain, clipped))
            clipped_count += clipped > plain
            n += 1
        per_seq.append(seq)
    return 0.5 * reference_agg(per_seq, mode, len(v[0])), clipped_count / max(n, 1)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 6), st.integers(1, 8), st.sampled_from(AGG_MODES), st.floats(0.01, 2.0))
def test_value_loss_matches_reference(seed, batch, length, mode, clip):
    gen = torch.Generator().manual_seed(seed)
    v, old, ret = (torch.randn(batch, length, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = (torch.rand(batch, length, generator=gen) < 0.6).double()
    loss, stats = value_loss(v, old, ret, mask, clip, mode)
    ref_loss, ref_frac = reference_value_loss(v, old, ret, mask, clip, mode)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    assert stats["vf_clip_frac"].item() == pytest.approx(ref_frac, rel=1e-9, abs=1e-12)


def test_value_loss_gradient_is_zero_where_the_clipped_branch_dominates():
    old, ret = torch.zeros(1, 2), torch.tensor([[2.0, 0.1]])
    v = torch.tensor([[1.0, 1.0]], requires_grad=True)  # both moved 1.0 from old; clip 0.5
    loss, stats = value_loss(v, old, ret, torch.ones(1, 2), 0.5, "token-mean")
    loss.backward()
    # token 0: clipped value 0.5 is further from 2 than 1.0 is -> clipped branch, no gradient
    # token 1: unclipped (1 - 0.1)^2 > (0.5 - 0.1)^2 -> plain branch, gradient 0.5 * 2 * 0.9 / 2
    assert v.grad[0, 0] == 0 and v.grad[0, 1].item() == pytest.approx(0.45)
    assert stats["vf_clip_frac"].item() == 0.5


@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_normalisers_make_chunks_sum_to_full_batch(mode):
    lp, old, adv, mask = rand_inputs(0, 7, 9)
    mask[3] = 0  # an empty sequence counts in no mode
    lp.requires_grad_(True)
    full, _ = policy_loss(lp, old, adv, mask, 0.2, 0.3, mode)
    (g_full,) = torch.autograd.grad(full, lp)
    num_tokens, num_seqs = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    parts = [
        policy_loss(lp[s], old[s], adv[s], mask[s], 0.2, 0.3, mode, num_tokens=num_tokens, num_seqs=num_seqs)[0]
        for s in (slice(0, 2), slice(2, 5), slice(5, 7))
    ]
    (g_parts,) = torch.autograd.grad(sum(parts), lp)
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_parts, g_full)


def test_gradient_is_zero_where_clipped():
    old = torch.zeros(1, 4)
    lp = torch.tensor([[0.5, -0.5, 0.5, -0.5]], requires_grad=True)  # ratios e^±0.5, outside [0.8, 1.2]
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, stats = policy_loss(lp, old, adv, torch.ones(1, 4), 0.2, 0.2, "token-mean")
    loss.backward()
    # clipped: A>0 with r>1+eps and A<0 with r<1-eps; the others keep the gradient
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == 0
    assert lp.grad[0, 2] != 0 and lp.grad[0, 3] != 0
    assert stats["clip_frac"].item() == 0.5


def test_ratio_one_gives_plain_policy_gradient():
    lp, _, adv, mask = rand_inputs(1, 3, 5)
    lp.requires_grad_(True)
    loss, stats = policy_loss(lp, lp.detach(), adv, mask, 0.2, 0.2, "token-mean")
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * mask / mask.sum())
    assert stats["approx_kl"].item() == 0 and stats["ratio_mean"].item() == 1 and stats["clip_frac"].item() == 0


def test_masked_mean_and_mismatch_kl():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 0]])
    assert masked_mean(x, mask).item() == 2.0
    torch.testing.assert_close(masked_mean(x, mask, dim=-1), torch.tensor([2.0, 0.0]))
    learner = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.2, -9.0, -0.5]])
    m = torch.tensor([[1, 0, 1]])
    r = math.exp(0.2)
    assert mismatch_kl(learner, rollout, m).item() == pytest.approx((r - 1 - 0.2) / 2, rel=1e-6)
    assert mismatch_kl(rollout, rollout, m).item() == 0


def test_unknown_agg_mode():
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")
