"""The learner's stream metrics (omrl_stream_length/pending/lag), read from a real Redis at scrape time."""

from __future__ import annotations

import redis
from prometheus_client import CollectorRegistry, generate_latest

from services.common.grpc_server import free_port
from services.common.stream import TrajectoryStream
from services.learner.prometheus_metrics import register_stream_collector


def values(registry: CollectorRegistry) -> dict[str, float]:
    return {name: registry.get_sample_value(f"omrl_stream_{name}") for name in ("length", "pending", "lag")}


def test_length_pending_and_lag_follow_the_consumer_group(redis_url, run_name):
    client = redis.Redis.from_url(redis_url)
    stream = TrajectoryStream(client, f"omrl:{run_name}:trajectories")
    registry = CollectorRegistry()
    register_stream_collector(stream, registry)
    try:
        stream.ensure_group()
        assert values(registry) == {"length": 0, "pending": 0, "lag": 0}
        for i in range(3):
            stream.publish([], f"b{i}")
        assert values(registry) == {"length": 3, "pending": 0, "lag": 3}
        taken = stream.read("learner-0", count=2, block_ms=100)
        assert values(registry) == {"length": 3, "pending": 2, "lag": 1}
        stream.ack([taken[0].entry_id])
        assert values(registry) == {"length": 3, "pending": 1, "lag": 1}
    finally:
        client.delete(stream.key)


def test_unreachable_redis_leaves_the_stream_out_but_the_endpoint_answers():
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    registry = CollectorRegistry()
    register_stream_collector(TrajectoryStream(dead, "omrl:gone:trajectories"), registry)
    assert values(registry) == {"length": None, "pending": None, "lag": None}
    assert generate_latest(registry) == b""
