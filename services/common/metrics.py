"""Prometheus metrics under one naming scheme, `omrl_<service>_<name>`.

Create metrics only through these helpers: asking twice for the same name returns the same metric
(service cores are built more than once per process in tests), and asking for it with another type
or other labels fails loudly.

Conventions every service follows (docs/operations.md lists the whole catalogue):
- units in the name: `_seconds`, `_bytes`; counters end in `_total` and dashboards take their rate;
- latencies are histograms; per-step learner statistics are gauges holding the last step's value;
- label names mean the same everywhere: `env` (environment name), `op` (env call), `kind` (error
  class), `component` (reward function), `outcome`, `reason`, `term` (loss term), `against` (what a
  KL is measured against), `method`/`code` (gRPC), `state` (job state), `stage` (agent-loop stage);
- the scraper adds `job` (the service: envs, reward, rollout, learner, jobs-api), `run` and `instance`;
- a labelled counter whose label values are known up front is created with every child at zero
  (`preset`), so rates read 0 rather than "no data" before the first event.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# generation calls, weight loads: seconds on a small model, many minutes on a large one
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_created: weakref.WeakKeyDictionary[CollectorRegistry, dict] = weakref.WeakKeyDictionary()


def metric_name(service: str, name: str) -> str:
    return f"omrl_{service}_{name}"


def _get_or_create(
    cls, service: str, name: str, doc: str, labels: Sequence[str], registry: CollectorRegistry | None, **kwargs
):
    registry = registry if registry is not None else REGISTRY
    full = metric_name(service, name)
    table = _created.setdefault(registry, {})
    if full in table:
        metric, spec = table[full]
        if spec != (cls, tuple(labels)):
            raise ValueError(f"metric {full} already exists as {spec[0].__name__}{list(spec[1])}")
        return metric
    metric = cls(full, doc, labelnames=tuple(labels), registry=registry, **kwargs)
    table[full] = (metric, (cls, tuple(labels)))
    return metric


def counter(
    service: str, name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry | None = None
) -> Counter:
    return _get_or_create(Counter, service, name, doc, labels, registry)


def gauge(
    service: str, name: str, doc: str, labels: Sequence[str] = (), registry: CollectorRegistry | None = None
) -> Gauge:
    return _get_or_create(Gauge, service, name, doc, labels, registry)


def histogram(
    service: str,
    name: str,
    doc: str,
    labels: Sequence[str] = (),
    registry: CollectorRegistry | None = None,
    buckets: Sequence[float] = LATENCY_BUCKETS,
) -> Histogram:
    return _get_or_create(Histogram, service, name, doc, labels, registry, buckets=tuple(buckets))


def preset(metric, *label_values: Sequence[str]):
    """Creates the children `label_values` (one tuple per child) at zero; returns the metric."""
    for values in label_values:
        metric.labels(*values)
    return metric
