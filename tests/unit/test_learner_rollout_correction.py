"""The rollout correction (services/learner/rollout_correction.py) against a plain float64 loop over sequences,
turns and tokens: importance weights at every level, truncation and masking, the veto, the sums behind the
metrics; then through PolicyTrainer: rejected tokens leave the loss and its divisors, micro-batches still add
up to the full batch (also for GSPO, CISPO and the new aggregation modes), and the metrics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import AlgorithmConfig
from services.learner.losses import truncated_is_weights
from services.learner.policy_losses import POLICY_LOSSES
from services.learner.policy_losses.base import PolicyLoss
from services.learner.policy_losses.ppo_clip import PPOClip
from services.learner.rollout_correction import SUMS, RolloutCorrection, turn_ids
from services.learner.trainer import PolicyTrainer
from tests.support.learner import make_config as learner_config
from tests.support.smoke import synthetic_trajectories


def units(row_mask, level):
    """The token positions that share one ratio: each token, the sequence, or each run of model tokens."""
    tokens = [t for t, m in enumerate(row_mask) if m]
    if level == "token":
        return [[t] for t in tokens]
    if level in ("sequence", "geometric"):
        return [tokens] if tokens else []
    runs = []
    for t in tokens:
        if runs and runs[-1][-1] == t - 1:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


def reference(old, rollout, mask, fix):
    old, rollout, mask = old.tolist(), rollout.tolist(), mask.tolist()
    rows, width = len(mask), len(mask[0])
    weights, keep = [[0.0] * width for _ in range(rows)], [[0.0] * width for _ in range(rows)]
    lower = 1 / fix.cap if fix.lower is None else fix.lower
    sums = dict.fromkeys(SUMS, 0.0)
    for b in range(rows):
        vetoed = fix.veto is not None and any(
            mask[b][t] and old[b][t] - rollout[b][t] < math.log(fix.veto) for t in range(width)
        )
        for unit in units(mask[b], fix.level):
            log_ratio = sum(old[b][t] - rollout[b][t] for t in unit)
            if fix.level in ("geometric", "turn"):
                log_ratio /= len(unit)
            raw = math.exp(min(max(log_ratio, -20.0), 20.0))
            kept = not vetoed and (fix.mode == "truncate" or lower <= raw <= fix.cap)
            for t in unit:
                keep[b][t] = float(kept)
                weights[b][t] = (raw if fix.mode == "mask" else min(raw, fix.cap)) if kept else 0.0
                sums["tis_weight"] += weights[b][t]
                sums["tis_clipped"] += raw > fix.cap
        removed = sum(mask[b]) - sum(keep[b])
        sums["rollout_masked_tokens"] += removed
        sums["rollout_masked_seqs"] += removed > 0
        sums["rollout_vetoed_seqs"] += vetoed
    return weights, keep, sums


def rand_logprobs(seed, batch, length, spread):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 4
    rollout = old + torch.randn(batch, length, generator=gen, dtype=torch.float64) * spread
    mask = (torch.rand(batch, length, generator=gen) < 0.6).double()
    return old, rollout, mask


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 2**31),
    st.integers(1, 6),
    st.integers(1, 12),
    st.sampled_from(["token", "sequence", "geometric", "turn"]),
    st.sampled_from(["truncate", "mask"]),
    st.sampled_from([1.2, 2.0, 5.0]),
    st.sampled_from([None, 0.0, 0.7]),
    st.sampled_from([None, 1e-3, 0.3]),
    st.sampled_from([0.05, 0.5, 2.0]),
)
def test_matches_reference(seed, batch, length, level, mode, cap, lower, veto, spread):
    old, rollout, mask = rand_logprobs(seed, batch, length, spread)
    fix = RolloutCorrection(cap=cap, level=level, mode=mode, lower=lower, veto=veto)
    out = fix(old, rollout, mask)
    weights, keep, sums = reference(old, rollout, mask, fix)
    torch.testing.assert_close(out.weights, torch.tensor(weights, dtype=torch.float64), rtol=1e-12, atol=0)
    assert not out.weights.requires_grad
    if fix.rejects:
        assert torch.equal(out.keep, torch.tensor(keep, dtype=torch.float64))
        assert (out.keep <= mask).all()
    else:
        assert out.keep is None and torch.equal(torch.tensor(keep, dtype=torch.float64), mask)
    for key in SUMS:
        assert out.sums[key].item() == pytest.approx(sums[key], rel=1e-12, abs=1e-12), key


def test_the_default_is_todays_token_truncation():
    old, rollout, mask = rand_logprobs(3, 5, 9, 1.0)
    fix = RolloutCorrection.from_config(AlgorithmConfig())
    assert (fix.cap, fix.level, fix.mode, fix.lower, fix.veto, fix.apply) == (
        2.0,
        "token",
        "truncate",
        None,
        None,
        True,
    )
    assert not fix.rejects
    out = fix(old, rollout, mask)
    assert torch.equal(out.weights, truncated_is_weights(old, rollout, 2.0) * mask)
    assert not RolloutCorrection.from_config(AlgorithmConfig(tis_cap=0)).enabled


def test_turns_are_runs_of_model_tokens_and_share_one_ratio():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0]])
    assert turn_ids(mask).tolist() == [[0, 1, 1, 0, 0, 2, 0, 3], [1, 1, 1, 1, 0, 0, 0, 0]]
    old = torch.zeros(2, 8, dtype=torch.float64)
    rollout = -torch.tensor([[0, 0.1, 0.3, 0, 0, 2.0, 0, -1.0], [0.1, 0.1, 0.1, 0.5, 0, 0, 0, 0]], dtype=torch.float64)
    out = RolloutCorrection(cap=10.0, level="turn")(old, rollout, mask.double())
    e = math.exp
    expected = [[0, e(0.2), e(0.2), 0, 0, e(2.0), 0, e(-1.0)], [e(0.2)] * 4 + [0] * 4]
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64))


def test_mask_mode_and_veto_worked_example():
    """Geometric level, band [0.5, 2]: row 0 (mean log-ratio 1) leaves the band, row 1 (0.1) stays, row 2 would
    stay but holds a token with ratio e^-8 < veto 1e-3; the weights of the kept rows are their true ratios."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(3, 3, dtype=torch.float64)
    rollout = -torch.tensor([[1.0, 1.0, 0.0], [0.1, 0.2, 0.0], [4.0, 4.0, -8.0]], dtype=torch.float64)
    fix = RolloutCorrection(cap=2.0, level="geometric", mode="mask", veto=1e-3)
    out = fix(old, rollout, mask.double())
    assert out.keep.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0]]
    torch.testing.assert_close(out.weights[1], torch.full((3,), math.exp(0.1), dtype=torch.float64))
    sums = {k: v.item() for k, v in out.sums.items()}
    assert sums["rollout_masked_tokens"] == 5 and sums["rollout_masked_seqs"] == 2 and sums["rollout_vetoed_seqs"] == 1
    metrics = fix.metrics(sums, tokens=8.0, seqs=3.0)
    assert metrics["rollout_is_masked_fraction"] == 5 / 8 and metrics["rollout_is_veto_fraction"] == 1 / 3
    assert metrics["rollout_is_seq_masked_fraction"] == 2 / 3 and metrics["rollout_is_masked_tokens"] == 5
    assert metrics["tis_weight_mean"] == pytest.approx(math.exp(0.1))
    assert metrics["tis_clip_frac"] == pytest.approx(2 / 8)  # row 0's ratio e is above the cap (row 2's is 1)


def test_metrics_only_keeps_the_rejection_and_drops_the_weights():
    old, rollout, mask = rand_logprobs(5, 4, 7, 2.0)
    out = RolloutCorrection(cap=2.0, mode="mask", apply=False)(old, rollout, mask)
    assert out.weights is None and out.keep is not None and (out.keep < mask).any()


def test_the_config_names_the_settings_and_checks_the_band():
    config = AlgorithmConfig(
        tis_cap=3.0,
        rollout_is_level="turn",
        rollout_is_mode="mask",
        rollout_is_threshold_lower=0.2,
        rollout_is_veto_threshold=1e-4,
        rollout_is=False,
    )
    fix = RolloutCorrection.from_config(config)
    assert (fix.cap, fix.level, fix.mode, fix.lower, fix.veto, fix.apply) == (3.0, "turn", "mask", 0.2, 1e-4, False)
    with pytest.raises(ValueError, match="rollout_is_threshold_lower"):
        AlgorithmConfig(tis_cap=2.0, rollout_is_threshold_lower=2.5)
    with pytest.raises(ValueError):
        AlgorithmConfig(rollout_is_level="segment")


# -- through the trainer ------------------------------------------------------------------------------


def make_config(**algorithm):
    return learner_config({"steps": 10}, **{"entropy_coeff": 0.0, **algorithm})


class RecordingLoss(PPOClip):
    """PPO's loss, recording what the trainer hands it."""

    name = "recording_for_test"
    calls: list = []

    def __call__(self, inputs):
        RecordingLoss.calls.append(inputs)
        return super().__call__(inputs)


@pytest.fixture
def recording():
    RecordingLoss.calls = []
    POLICY_LOSSES.register(RecordingLoss.name)(RecordingLoss)
    yield RecordingLoss.name
    POLICY_LOSSES.unregister(RecordingLoss.name)


REJECTING = {
    "tis_cap": 5.0,
    "rollout_is_level": "geometric",
    "rollout_is_mode": "mask",
    "rollout_is_veto_threshold": 0.03,
}


@pytest.mark.parametrize("apply", [True, False])
def test_rejected_tokens_leave_the_loss_and_its_divisors(model_dir, recording, apply):
    trajs = synthetic_trajectories(8, 4, seed=7)
    trainer = PolicyTrainer(make_config(policy_loss=recording, rollout_is=apply, **REJECTING), model_dir)
    assert isinstance(trainer.policy_loss, PolicyLoss) and not trainer._fused_scoring(1)
    metrics = trainer.train_step(trajs)
    calls = RecordingLoss.calls
    kept = sum(c.response_mask.sum().item() for c in calls)
    assert 0 < kept < metrics["num_tokens"]  # the synthetic rollout logprobs are far from the model's
    assert all(c.num_tokens == kept for c in calls)
    assert all(c.num_seqs == sum((c2.response_mask.sum(-1) > 0).sum().item() for c2 in calls) for c in calls)
    assert all((c.is_weights is not None) == apply for c in calls)
    assert metrics["rollout_is_masked_tokens"] == metrics["num_tokens"] - kept
    assert metrics["rollout_is_masked_fraction"] == pytest.approx(1 - kept / metrics["num_tokens"])
    assert 0 < metrics["rollout_is_seq_masked_fraction"] <= 1 and 0 <= metrics["rollout_is_veto_fraction"] <= 1
    assert metrics["ppo_kl"] == pytest.approx(0.0, abs=1e-6) and metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)


CASES = [
    ("gspo", "seq-mean-token-sum-norm", {}),
    ("cispo", "token-sum", {}),
    ("ppo_clip", "seq-mean-token-mean", {"use_kl_loss": True, "kl_loss_type": "k3+", "kl_loss_coef": 0.5}),
    ("ppo_clip", "token-mean", {**REJECTING, "rollout_is_level": "turn", "entropy_coeff": 0.1}),
    ("gspo", "seq-mean-token-mean", {**REJECTING, "rollout_is_mode": "truncate"}),
    ("cispo", "seq-mean-token-sum", {**REJECTING, "ppo_mini_batch_size": 4}),
]


@pytest.mark.parametrize(("loss", "mode", "extra"), CASES)
def test_micro_batches_equal_the_full_batch(model_dir, loss, mode, extra):
    trajs = synthetic_trajectories(7, 4, seed=5)
    runs = []
    for size in (2, 64):
        config = make_config(policy_loss=loss, loss_agg_mode=mode, micro_batch_size=size, ppo_epochs=2, **extra)
        trainer = PolicyTrainer(config, model_dir)
        trainer.train_step(trajs)
        runs.append(trainer.train_step(trajs))
    small, full = runs
    for key in ("loss", "pg_loss", "grad_norm", "ppo_kl", "approx_kl", "clip_frac", "tis_weight_mean"):
        assert small[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    assert small["ppo_kl"] != 0.0  # the second epoch moved the policy
