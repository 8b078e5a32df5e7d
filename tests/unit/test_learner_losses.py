import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from services.learner.losses import AGG_MODES, aggregate, masked_mean, mismatch_kl, policy_loss


def reference(lp, old, adv, mask, lo, hi, mode):
    """Token by token, in plain Python."""
    lp, old, adv, mask = (x.tolist() for x in (lp, old, adv, mask))
    per_seq, tokens, clipped, kl, ratios = [], [], 0, 0.0, 0.0
    for b in range(len(lp)):
        seq = []
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            r = math.exp(lp[b][t] - old[b][t])
            a = adv[b][t]
            u, c = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
            seq.append(max(u, c))
            clipped += c > u
            kl += r - 1 - math.log(r)
            ratios += r
        per_seq.append(seq)
        tokens += seq
    n = len(tokens)
    nonempty = [s for s in per_seq if s]
    loss = {"token-mean": sum(tokens) / max(n, 1),
            "seq-mean-token-sum": sum(sum(s) for s in nonempty) / max(len(nonempty), 1),
            "seq-mean-token-mean": sum(sum(s) / len(s) for s in nonempty) / max(len(nonempty), 1)}[mode]
    n = max(n, 1)
    return loss, {"clip_frac": clipped / n, "approx_kl": kl / n, "ratio_mean": ratios / n}


def rand_inputs(seed, batch, length, p_mask=0.6):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    lp = old + torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=gen) < p_mask).double()
    return lp, old, adv, mask


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 31), st.integers(1, 6), st.integers(1, 8), st.sampled_from(AGG_MODES),
       st.floats(0.0, 0.5), st.floats(0.0, 2.0))
def test_policy_loss_matches_reference(seed, batch, length, mode, lo, hi):
    lp, old, adv, mask = rand_inputs(seed, batch, length)
    loss, stats = policy_loss(lp, old, adv, mask, lo, hi, mode)
    ref_loss, ref_stats = reference(lp, old, adv, mask, lo, hi, mode)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_normalisers_make_chunks_sum_to_full_batch(mode):
    lp, old, adv, mask = rand_inputs(0, 7, 9)
    mask[3] = 0  # an empty sequence counts in no mode
    lp.requires_grad_(True)
    full, _ = policy_loss(lp, old, adv, mask, 0.2, 0.3, mode)
    (g_full,) = torch.autograd.grad(full, lp)
    num_tokens, num_seqs = mask.sum().item(), (mask.sum(-1) > 0).sum().item()
    parts = [policy_loss(lp[s], old[s], adv[s], mask[s], 0.2, 0.3, mode, num_tokens=num_tokens,
                         num_seqs=num_seqs)[0] for s in (slice(0, 2), slice(2, 5), slice(5, 7))]
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
