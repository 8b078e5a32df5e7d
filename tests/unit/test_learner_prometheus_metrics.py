"""How one learner step's summary becomes Prometheus metrics (services/learner/prometheus_metrics.py)."""

from prometheus_client import REGISTRY

from services.learner.prometheus_metrics import export_summary, loss_term


def sample(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def summary(step: int, **extra) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "loss": 0.5,
        "pg_loss": 0.4,
        "vf_loss": 0.1,
        "approx_kl": 0.01,
        "mismatch_kl": 1e-4,
        "entropy": 2.0,
        "grad_norm": 3.0,
        "clip_frac": 0.2,
        "reward_mean": 0.3,
        "success_rate": 0.25,
        "staleness": 0.0,
        "step_seconds": 4.0,
        "push_seconds": 0.5,
        "checkpoint_seconds": 1.5,
        "trajectories": 64,
        "num_tokens": 900.0,
        "skipped_updates": 0.0,
        "reward/goal": 0.25,
        "reward/format": 0.1,
        "weights_checksum": "abc",
        "pushes": [{"ok": True}, {"ok": False}],
        **extra,
    }


def test_summary_keys_become_gauges_and_counters():
    steps_before = sample("omrl_learner_steps_total") or 0
    tokens_before = sample("omrl_learner_trained_tokens_total") or 0
    failures_before = sample("omrl_learner_weight_push_failures_total") or 0
    export_summary(summary(7))
    assert sample("omrl_learner_step") == 7 and sample("omrl_learner_policy_version") == 7
    assert sample("omrl_learner_steps_total") == steps_before + 1
    assert sample("omrl_learner_trained_tokens_total") == tokens_before + 900
    assert sample("omrl_learner_weight_push_failures_total") == failures_before + 1
    assert sample("omrl_learner_loss", term="total") == 0.5
    assert sample("omrl_learner_loss", term="policy") == 0.4
    assert sample("omrl_learner_loss", term="value") == 0.1
    assert sample("omrl_learner_kl", against="old_policy") == 0.01
    assert sample("omrl_learner_kl", against="rollout") == 1e-4
    assert sample("omrl_learner_reward_component", component="goal") == 0.25
    assert sample("omrl_learner_weight_push_seconds") == 0.5
    assert sample("omrl_learner_clip_fraction") == 0.2
    assert sample("omrl_learner_checkpoint_seconds") == 1.5


def test_a_step_without_checkpoint_keeps_the_last_checkpoint_time():
    export_summary(summary(8, checkpoint_seconds=2.5))
    export_summary(summary(9, checkpoint_seconds=0.0))
    assert sample("omrl_learner_checkpoint_seconds") == 2.5


def test_loss_terms():
    assert [loss_term(k) for k in ("loss", "pg_loss", "vf_loss", "kl_loss", "entropy_loss", "_loss", "kl")] == [
        "total",
        "policy",
        "value",
        "kl",
        "entropy",
        None,
        None,
    ]


def test_importance_sampling_and_clip_statistics_become_gauges():
    export_summary(summary(10, tis_weight_mean=0.97, tis_clip_frac=0.02, ratio_mean=1.01, clip_frac_lower=0.003))
    assert sample("omrl_learner_importance_weight_mean") == 0.97
    assert sample("omrl_learner_importance_weight_capped_fraction") == 0.02
    assert sample("omrl_learner_ratio_mean") == 1.01
    assert sample("omrl_learner_dual_clip_fraction") == 0.003


def test_ppo_kl_and_rollout_rejections_become_gauges():
    export_summary(
        summary(
            11,
            ppo_kl=-0.002,
            rollout_is_masked_fraction=0.1,
            rollout_is_seq_masked_fraction=0.25,
            rollout_is_veto_fraction=0.05,
        )
    )
    assert sample("omrl_learner_kl", against="old_policy_k1") == -0.002
    assert sample("omrl_learner_kl", against="old_policy") == 0.01  # approx_kl keeps its label
    assert sample("omrl_learner_rollout_rejected_token_fraction") == 0.1
    assert sample("omrl_learner_rollout_rejected_sequence_fraction") == 0.25
    assert sample("omrl_learner_rollout_vetoed_sequence_fraction") == 0.05
