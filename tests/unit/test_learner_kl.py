import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.learner.kl import KL_ESTIMATORS, AdaptiveKLController, KLController, build_kl_controller, kl_estimate


def reference_kl(lp, ref, kind):
    """Per token, in plain Python; KL(policy || reference) estimated from the policy's own samples. A `+`
    suffix changes the gradient only, so its value is the estimator's."""
    kind = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}.get(kind.rstrip("+"), kind.rstrip("+"))
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
    if kind.rstrip("+") not in ("kl", "k1"):
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


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(-15, 0), st.floats(-15, 0)), min_size=1, max_size=20),
    st.sampled_from(["kl+", "k1+", "abs+", "low_var_kl+", "k3+"]),
)
def test_straight_through_keeps_the_value_and_takes_k2s_gradient(pairs, kind):
    """verl's `+` suffix: the estimator's value, bit for bit, and the gradient of 0.5 * (log p - log p_ref)^2."""
    lp = torch.tensor([p for p, _ in pairs], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    value = kl_estimate(lp, ref, kind)
    assert torch.equal(value.detach(), kl_estimate(lp.detach(), ref, kind[:-1]))
    (grad,) = torch.autograd.grad(value.sum(), lp)
    assert grad.tolist() == pytest.approx([p - q for p, q in pairs], rel=1e-12, abs=1e-12)


def test_k3_plus_gradient_is_unbiased_for_the_kl_gradient_and_k3s_is_not():
    """Tokens sampled from p = softmax(theta): the mean pathwise gradient of k3+ over the samples is the gradient
    of KL(p || q) in theta (k2's is E[(log p - log q) grad log p]); k3's own is that of KL(q || p) instead."""
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_(True)
    log_q = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), -1)
    log_p = torch.log_softmax(theta, -1)
    (true_grad,) = torch.autograd.grad((log_p.exp() * (log_p - log_q)).sum(), theta, retain_graph=True)
    (reverse_grad,) = torch.autograd.grad((log_q.exp() * (log_q - log_p)).sum(), theta)
    x = torch.multinomial(log_p.detach().exp(), 400_000, replacement=True, generator=gen)

    def mean_grad(kind):
        lp = torch.log_softmax(theta, -1)[x]
        (grad,) = torch.autograd.grad(kl_estimate(lp, log_q[x], kind).mean(), theta)
        return grad

    torch.testing.assert_close(mean_grad("k3+"), true_grad, rtol=0.05, atol=5e-3)
    torch.testing.assert_close(mean_grad("k3"), reverse_grad, rtol=0.05, atol=5e-3)
    assert (reverse_grad - true_grad).abs().max() > 0.05  # the two differ by more than the tolerance


def test_aliases_and_the_config_names():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -0.5])
    for alias, name in (("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")):
        assert torch.equal(kl_estimate(lp, ref, alias), kl_estimate(lp, ref, name))
    for name in ("mse+", "k2+", "k4", "low_var_kl++"):
        with pytest.raises(ValueError, match="unknown KL estimator"):
            kl_estimate(lp, ref, name)
    from services.common.config import AlgorithmConfig

    config = AlgorithmConfig(kl_loss_type="k3+", kl_penalty="k1")
    assert (config.kl_loss_type, config.kl_penalty) == ("k3+", "k1")
    assert set(typing.get_args(AlgorithmConfig.model_fields["kl_loss_type"].annotation)) == set(KL_ESTIMATORS)
