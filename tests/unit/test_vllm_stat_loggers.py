"""`rollout.vllm_metrics`: the stat loggers the vLLM backend gives its engine, checked with vLLM's own
`StatLoggerManager` (no engine started). Off, vLLM adds no Prometheus logger and no `vllm:*` series; on,
it adds its own (tests/integration/test_vllm_backend.py scrapes those from a real engine)."""

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY  # noqa: E402
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager  # noqa: E402

from services.engines.vllm import EngineStatsLogger, stat_loggers  # noqa: E402


def registered_names() -> set[str]:
    return {name for names in REGISTRY._collector_to_names.values() for name in names}


def test_with_vllm_metrics_vllm_adds_its_own_prometheus_logger():
    assert stat_loggers(True) == [EngineStatsLogger]


def test_without_vllm_metrics_vllm_adds_no_prometheus_logger_and_no_series():
    before = registered_names()
    manager = StatLoggerManager(None, custom_stat_loggers=stat_loggers(False), enable_default_loggers=False)
    prometheus = [logger for logger in manager.stat_loggers if isinstance(logger, PrometheusStatLogger)]
    assert [type(logger).__name__ for logger in prometheus] == ["SilentPrometheusStatLogger"]
    manager.log_engine_initialized()
    manager.record(None, None)
    manager.record_sleep_state(1, 1)
    manager.record_admission_rejection("queue full")
    manager.log()
    assert registered_names() == before
