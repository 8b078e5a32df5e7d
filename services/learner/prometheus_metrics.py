"""The learner's Prometheus metrics: each step's summary as gauges and counters, and the trajectory
stream's backlog, read from Redis at scrape time (the learner is the stream's one consumer)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.common import metrics
from services.common.stream import TrajectoryStream

log = logging.getLogger(__name__)

STEP = metrics.gauge("learner", "step", "Last completed learner step")
STEPS = metrics.counter("learner", "steps_total", "Completed learner steps")
POLICY_VERSION = metrics.gauge("learner", "policy_version", "Policy version after the last step")
LOSS = metrics.gauge(
    "learner", "loss", "Loss of the last step by term (total, policy, value, ...): do not sum", ["term"]
)
KL = metrics.gauge(
    "learner",
    "kl",
    "KL of the last step, per token, against the old policy, the rollout "
    "engine's sampling policy or the reference model",
    ["against"],
)
REWARD_COMPONENT = metrics.gauge(
    "learner",
    "reward_component",
    "Mean weighted reward per trajectory of the last step, by reward component",
    ["component"],
)
TRAINED_TRAJECTORIES = metrics.counter("learner", "trained_trajectories_total", "Trajectories trained on")
TRAINED_TOKENS = metrics.counter("learner", "trained_tokens_total", "Model tokens trained on")
SKIPPED_UPDATES = metrics.counter(
    "learner", "skipped_updates_total", "Optimizer steps skipped for a non-finite gradient norm"
)
PUSH_FAILURES = metrics.counter("learner", "weight_push_failures_total", "Weight pushes a rollout server did not apply")
DROPPED = metrics.preset(
    metrics.counter("learner", "dropped_trajectories_total", "Trajectories not trained on", ["reason"]),
    ("stale",),
    ("filtered",),
)
FILTERED_GROUPS = metrics.counter(
    "learner", "filtered_groups_total", "Groups dynamic sampling dropped: every episode got the same reward"
)
DEAD_LETTER_REASONS = (
    "undecodable",
    "too_large",
    "lengths",
    "too_long",
    "token_id",
    "turns",
    "non_finite",
    "logprob",
    "anchor",
    "version",
    "baseline",
    "train_error",
    "non_finite_update",
)
DEAD_LETTERS = metrics.preset(
    metrics.counter(
        "learner",
        "dead_letters_total",
        "Groups sent to the dead-letter stream instead of a step (an unreadable entry counts one)",
        ["reason"],
    ),
    *[(r,) for r in DEAD_LETTER_REASONS],
)
CHECKPOINT_SECONDS = metrics.gauge("learner", "checkpoint_seconds", "Wall time of the last checkpoint")

# summary key -> gauge of the same meaning (the value of the last step)
SCALARS = {
    key: metrics.gauge("learner", name, doc)
    for key, name, doc in (
        ("step_seconds", "step_seconds", "Wall time of the last step (collect, train, push, checkpoint)"),
        ("push_seconds", "weight_push_seconds", "Wall time of the last weight push to every rollout server"),
        ("entropy", "entropy", "Mean token entropy of the policy on the last batch"),
        ("grad_norm", "grad_norm", "Gradient norm before clipping"),
        ("clip_frac", "clip_fraction", "Share of tokens whose ratio was clipped"),
        ("clip_frac_lower", "dual_clip_fraction", "Share of tokens whose loss the dual clip (clip_ratio_c) capped"),
        ("ratio_mean", "ratio_mean", "Mean ratio pi_new / pi_old over the updated tokens"),
        (
            "tis_weight_mean",
            "importance_weight_mean",
            "Mean truncated importance weight min(pi_learner / pi_rollout, tis_cap) over the last batch's tokens",
        ),
        (
            "tis_clip_frac",
            "importance_weight_capped_fraction",
            "Share of tokens whose importance weight was cut to tis_cap",
        ),
        (
            "rollout_is_masked_fraction",
            "rollout_rejected_token_fraction",
            "Share of tokens the rollout correction rejected (mask mode, veto) from the last batch's loss",
        ),
        (
            "rollout_is_seq_masked_fraction",
            "rollout_rejected_sequence_fraction",
            "Share of sequences with a token the rollout correction rejected",
        ),
        (
            "rollout_is_veto_fraction",
            "rollout_vetoed_sequence_fraction",
            "Share of sequences the rollout correction's veto rejected whole",
        ),
        ("reward_mean", "reward_mean", "Mean trajectory reward of the last batch"),
        ("success_rate", "success_rate", "Share of successful episodes in the last batch"),
        ("staleness", "staleness", "Mean policy-version lag of the trained tokens"),
        ("response_len_mean", "response_tokens_mean", "Mean model tokens per trajectory"),
    )
}
LOSS_TERMS = {"loss": "total", "pg_loss": "policy", "vf_loss": "value"}
KL_KEYS = {
    "approx_kl": "old_policy",
    "ppo_kl": "old_policy_k1",
    "mismatch_kl": "rollout",
    "ref_kl": "reference",
    "kl_ref": "reference",
}


def loss_term(key: str) -> str | None:
    """`loss` -> total, `pg_loss` -> policy, `vf_loss` -> value, any other `<x>_loss` -> x."""
    if key in LOSS_TERMS:
        return LOSS_TERMS[key]
    return key[: -len("_loss")] if key.endswith("_loss") and len(key) > len("_loss") else None


def export_summary(summary: dict[str, Any]) -> None:
    """Publishes one step's summary (LearnerService.run_step) on the process' metrics endpoint."""
    STEP.set(summary["step"])
    STEPS.inc()
    POLICY_VERSION.set(summary["policy_version"])
    for key, value in summary.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if key in SCALARS:
            SCALARS[key].set(value)
        elif key in KL_KEYS:
            KL.labels(KL_KEYS[key]).set(value)
        elif key.startswith("reward/"):
            REWARD_COMPONENT.labels(key.split("/", 1)[1]).set(value)
        elif (term := loss_term(key)) is not None:
            LOSS.labels(term).set(value)
    if summary.get("checkpoint_seconds"):  # 0.0 means this step wrote no checkpoint
        CHECKPOINT_SECONDS.set(summary["checkpoint_seconds"])
    TRAINED_TRAJECTORIES.inc(summary.get("trajectories", 0))
    TRAINED_TOKENS.inc(summary.get("num_tokens", 0))
    SKIPPED_UPDATES.inc(summary.get("skipped_updates", 0))
    FILTERED_GROUPS.inc(summary.get("groups_filtered", 0))
    PUSH_FAILURES.inc(sum(1 for push in summary.get("pushes", []) if not push.get("ok")))


class StreamCollector:
    """`omrl_stream_{length,pending,lag}` of the run's trajectory stream, read when scraped: entries
    in the stream, entries delivered to the learner and not yet acknowledged (trained on but not
    checkpointed), and entries not yet delivered at all. A Redis failure leaves them out of that
    scrape (the stream's absence is the signal) rather than failing the whole endpoint: the reads use
    their own connection with a short timeout and no retries, well inside a scrape's deadline."""

    def __init__(self, stream: TrajectoryStream, timeout_s: float = 2.0):
        self.stream = TrajectoryStream(_quick_client(stream.client, timeout_s), stream.key, stream.group)

    def describe(self) -> list:
        return []  # values come from Redis: nothing to read at registration time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            values = {"length": self.stream.length(), "pending": self.stream.pending_count(), "lag": self.stream.lag()}
        except (redis.RedisError, OSError) as exc:
            log.warning("stream metrics unavailable: %s", exc)
            return
        docs = {
            "length": "Entries in the trajectory stream",
            "pending": "Entries delivered to the learner and not yet acknowledged",
            "lag": "Entries not yet delivered to the learner",
        }
        for name, value in values.items():
            yield GaugeMetricFamily(metrics.metric_name("stream", name), docs[name], value=value)


def _quick_client(client: redis.Redis, timeout_s: float) -> redis.Redis:
    pool = client.connection_pool
    kwargs = {
        **pool.connection_kwargs,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    return redis.Redis(
        connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, max_connections=2, **kwargs)
    )


def register_stream_collector(stream: TrajectoryStream, registry: CollectorRegistry | None = None) -> StreamCollector:
    collector = StreamCollector(stream)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
