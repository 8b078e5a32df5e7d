"""KL to the frozen reference policy: per-token estimators and the in-reward coefficient controllers
(the names and formulas of verl's `kl_penalty` and `apply_kl_penalty`)."""

from __future__ import annotations

import math

import torch

KL_BASE = ("kl", "abs", "mse", "low_var_kl")
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
KL_ESTIMATORS = (*KL_BASE, *KL_ALIASES, *(f"{name}+" for name in (*KL_BASE, *KL_ALIASES) if name not in ("mse", "k2")))
"""verl's `kl_penalty` names: the four estimators, their k1/k2/k3 aliases, and each with a `+` suffix
(straight-through: that estimator's value, k2's gradient; k2 itself needs none)."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    `kl` (k1): log p - log p_ref; `abs`: |k1|; `mse` (k2): 0.5 * k1^2; `low_var_kl` (k3): r - 1 - log r with
    r = p_ref / p, clamped to [-10, 10] as in verl (non-negative and unbiased, low variance). A `+` suffix
    (`k3+`) keeps the value and takes k2's gradient (k1 per token): k1 and k3 estimate the KL's value without
    bias, but only k2's gradient is an unbiased estimate of the KL's gradient. Aliases k1, k2, k3."""
    base = kind[:-1] if kind.endswith("+") else kind
    base = KL_ALIASES.get(base, base)
    if base not in KL_BASE or kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
    value = _estimate(logprobs, ref_logprobs, base)
    if not kind.endswith("+"):
        return value
    k2 = _estimate(logprobs, ref_logprobs, "mse")
    # the detached terms are added last so the value is the estimator's to the bit
    return k2 - k2.detach() + value.detach()


def _estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, base: str) -> torch.Tensor:
    diff = logprobs - ref_logprobs
    if base == "kl":
        return diff
    if base == "abs":
        return diff.abs()
    if base == "mse":
        return 0.5 * diff.square()
    log_r = (-diff).clamp(-20.0, 20.0)
    return (torch.expm1(log_r) - log_r).clamp(-10.0, 10.0)


class KLController:
    """The in-reward KL coefficient. `update` sees the step's mean per-token KL and its trajectory count."""

    def __init__(self, coef: float):
        self.value = float(coef)

    def update(self, current_kl: float, n_trajectories: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(KLController):
    """Ziegler et al. (2019): value *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon."""

    def __init__(self, coef: float, target: float, horizon: int):
        super().__init__(coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_trajectories: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_trajectories / self.horizon


def build_kl_controller(kind: str, coef: float, target: float, horizon: int) -> KLController:
    if kind == "fixed":
        return KLController(coef)
    if kind == "adaptive":
        return AdaptiveKLController(coef, target, horizon)
    raise ValueError(f"unknown kl_ctrl {kind!r}; known: fixed, adaptive")
