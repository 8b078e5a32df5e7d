"""The generation engine's own statistics, `omrl_rollout_engine_*`, fed by the backend from its engine's
scheduler (vLLM: `VllmBackend`'s stat logger, once per engine step). The names say rollout, where these engines
began; an `llm_judge` reward's engine, in the reward service, exports them too, under the reward pod's instance.

vLLM also exports them as `vllm:*` on the same endpoint, but the name a Prometheus stores for those
depends on the scrape protocol: prometheus_client escapes `:` to `_` when Prometheus 2.x negotiates
OpenMetrics, and keeps it for plain text or a UTF-8-aware Prometheus 3. These names hold either way."""

from __future__ import annotations

from services.common import metrics

KV_CACHE_USAGE = metrics.gauge(
    "rollout", "engine_kv_cache_usage", "Share of the engine's KV-cache blocks in use (0..1), at its last step"
)
REQUESTS = metrics.preset(
    metrics.gauge(
        "rollout",
        "engine_requests",
        "Requests in the engine at its last step: "
        "running (in the batch) or waiting (queued for KV-cache blocks or a batch "
        "slot)",
        ["state"],
    ),
    ("running",),
    ("waiting",),
)
PREFIX_CACHE_QUERIES = metrics.counter(
    "rollout", "engine_prefix_cache_queries_total", "Prompt tokens looked up in the engine's prefix cache"
)
PREFIX_CACHE_HITS = metrics.counter(
    "rollout", "engine_prefix_cache_hits_total", "Prompt tokens found in the engine's prefix cache"
)
PREEMPTIONS = metrics.counter(
    "rollout",
    "engine_preemptions_total",
    "Requests the engine preempted for lack of KV-cache blocks (recomputed later)",
)


def record_step(*, running: int, waiting: int, kv_cache_usage: float, prefix_queries: int, prefix_hits: int) -> None:
    REQUESTS.labels("running").set(running)
    REQUESTS.labels("waiting").set(waiting)
    KV_CACHE_USAGE.set(kv_cache_usage)
    PREFIX_CACHE_QUERIES.inc(prefix_queries)
    PREFIX_CACHE_HITS.inc(prefix_hits)


def record_preemptions(count: int) -> None:
    PREEMPTIONS.inc(count)
