import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.learner.kl import KL_ESTIMATORS, AdaptiveKLController, KLController, build_kl_controller, kl_estimate


def reference_kl(lp, ref, kind):
    """Per token, in plain Python; KL(policy || reference) estimated from the policy's own samples."""
    out = []
    for a, b in zip(lp, ref):
        d = a - b
        if kind == "kl":
            out.append(d)
        elif kind == "abs":
            out.append(abs(d))
        elif kind == "mse":
            out.append(0.5 * d * d)
        else:  # k3 with r = p_ref / p
            log_r = min(max(-d, -20.0), 20.0)
            out.append(min(max(math.exp(log_r) - 1 - log_r, -10.0), 10.0))
    return out


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-15, 0), st.floats(-15, 0)), min_size=1, max_size=20), st.sampled_from(KL_ESTIMATORS)
)
def test_estimators_match_reference(pairs, kind):
    lp = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    got = kl_estimate(lp, ref, kind).tolist()
    assert got == pytest.approx(reference_kl(lp.tolist(), ref.tolist(), kind), rel=1e-9, abs=1e-12)
    if kind != "kl":
        assert min(got) >= -1e-15  # non-negative up to rounding


def test_estimators_are_unbiased_for_the_true_kl():
    """k1 and k3 average to KL(p || q) over samples from p; k2 is close for nearby distributions."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 0.3, -1)
    q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 0.3, -1)
    true_kl = (p * (p / q).log()).sum().item()
    x = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    lp, ref = p.log()[x], q.log()[x]
    assert kl_estimate(lp, ref, "kl").mean().item() == pytest.approx(true_kl, rel=0.05)
    assert kl_estimate(lp, ref, "low_var_kl").mean().item() == pytest.approx(true_kl, rel=0.05)
    assert kl_estimate(lp, ref, "mse").mean().item() == pytest.approx(true_kl, rel=0.15)
    assert kl_estimate(lp, ref, "low_var_kl").var() < kl_estimate(lp, ref, "kl").var()


def test_unknown_estimator():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k9")


def test_fixed_controller_never_moves():
    ctrl = build_kl_controller("fixed", 0.05, 0.1, 100)
    ctrl.update(10.0, 1000)
    assert type(ctrl) is KLController and ctrl.value == 0.05


def test_adaptive_controller_follows_verl_formula_and_round_trips():
    ctrl = build_kl_controller("adaptive", 0.1, target=0.2, horizon=1000)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(0.3, 100)  # error 0.5 -> clipped to 0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    ctrl.update(0.18, 50)  # error -0.1
    assert ctrl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 50 / 1000))
    ctrl.update(float("nan"), 50)
    restored = build_kl_controller("adaptive", 0.1, target=0.2, horizon=1000)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value
    with pytest.raises(ValueError):
        build_kl_controller("pid", 0.1, 0.1, 1)
