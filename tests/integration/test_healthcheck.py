"""python -m services.common.healthcheck (the compose healthcheck and `helm test` command) against a real
gRPC server with the standard health service, a real HTTP endpoint, and a closed port."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from services.common.grpc_server import free_port, serve


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.common.healthcheck", *args], capture_output=True, text=True, timeout=30
    )


@pytest.fixture(scope="module")
def grpc_server():
    port, ready, loop = free_port(), threading.Event(), asyncio.new_event_loop()
    stop = asyncio.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(
            serve("probe-test", port, [], host="127.0.0.1", stop=stop, grace_s=0.1, ready=lambda _: ready.set())
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "server did not start"
    yield f"127.0.0.1:{port}"
    loop.call_soon_threadsafe(stop.set)
    thread.join(10)


def test_serving_grpc_server_is_healthy(grpc_server):
    proc = healthcheck(grpc_server)
    assert proc.returncode == 0, proc.stderr


def test_unknown_service_name_is_unhealthy(grpc_server):
    proc = healthcheck(grpc_server, "--service", "no.such.Service")
    assert proc.returncode == 1 and "NOT_FOUND" in proc.stderr


def test_closed_port_is_unhealthy_within_the_timeout():
    proc = healthcheck(f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr


def test_http_endpoint():
    server, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        port = server.server_address[1]
        assert healthcheck(f"http://127.0.0.1:{port}/metrics").returncode == 0
        missing = healthcheck(f"http://127.0.0.1:{free_port()}/metrics", "--timeout", "1")
        assert missing.returncode == 1 and "unhealthy" in missing.stderr
    finally:
        server.shutdown()
        thread.join(5)
