"""Prometheus metrics under one naming scheme, `omrl_<service>_<name>`.

Create metrics only through these helpers: asking twice for the same name returns the same metric
(service cores are built more than once per process in tests), and asking for it with another type
or other labels fails loudly.
"""
from __future__ import annotations

import weakref
from typing import Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_created: "weakref.WeakKeyDictionary[CollectorRegistry, dict]" = weakref.WeakKeyDictionary()


def metric_name(service: str, name: str) -> str:
    return f"omrl_{service}_{name}"


def _get_or_create(cls, service: str, name: str, doc: str, labels: Sequence[str],
                   registry: CollectorRegistry | None, **kwargs):
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


def counter(service: str, name: str, doc: str, labels: Sequence[str] = (),
            registry: CollectorRegistry | None = None) -> Counter:
    return _get_or_create(Counter, service, name, doc, labels, registry)


def gauge(service: str, name: str, doc: str, labels: Sequence[str] = (),
          registry: CollectorRegistry | None = None) -> Gauge:
    return _get_or_create(Gauge, service, name, doc, labels, registry)


def histogram(service: str, name: str, doc: str, labels: Sequence[str] = (),
              registry: CollectorRegistry | None = None, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
    return _get_or_create(Histogram, service, name, doc, labels, registry, buckets=tuple(buckets))
