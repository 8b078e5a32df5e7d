"""What every service's gRPC server shares: health, error mapping, metrics endpoint, graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from services.common import metrics
from services.common.errors import ServiceError

log = logging.getLogger(__name__)
AddServicer = Callable[[grpc.aio.Server], None]
BIND_HOST_ENV = "OMRL_BIND_HOST"


def bind_host(flag: str | None = None) -> str:
    """Where servers listen: the --host flag, else $OMRL_BIND_HOST, else loopback. Loopback by default
    so a service is reachable from the network only where a deployment says so (the chart and compose
    set 0.0.0.0)."""
    return flag or os.environ.get(BIND_HOST_ENV) or "127.0.0.1"


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns ServiceError into its status code and any other exception into INTERNAL (a reply never
    carries an error inside), and counts every call by method and code."""

    def __init__(self, service: str):
        self._requests = metrics.counter(
            service, "grpc_requests_total", "gRPC calls by method and status code", ["method", "code"]
        )
        self._latency = metrics.histogram(service, "grpc_request_seconds", "gRPC call latency", ["method"])

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                factory = getattr(grpc, f"{kind}_rpc_method_handler")
                return factory(
                    self._wrap(handler_call_details.method, behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _wrap(self, method: str, behavior: Callable) -> Callable:
        if inspect.isasyncgenfunction(behavior):

            async def stream(request, context):
                with self._observe(method) as outcome:
                    try:
                        async for item in behavior(request, context):
                            yield item
                    except Exception as exc:  # noqa: BLE001 - every failure becomes a status code
                        await self._abort(method, exc, context, outcome)

            return stream

        async def call(request, context):
            with self._observe(method) as outcome:
                try:
                    return await behavior(request, context)
                except Exception as exc:  # noqa: BLE001
                    await self._abort(method, exc, context, outcome)

        return call

    @contextlib.contextmanager
    def _observe(self, method: str):
        outcome = {"code": grpc.StatusCode.OK}
        start = time.perf_counter()
        try:
            yield outcome
        except asyncio.CancelledError:
            outcome["code"] = grpc.StatusCode.CANCELLED
            raise
        finally:
            self._requests.labels(method, outcome["code"].name).inc()
            self._latency.labels(method).observe(time.perf_counter() - start)

    @staticmethod
    async def _abort(method: str, exc: Exception, context, outcome: dict) -> None:
        if isinstance(exc, grpc.aio.AbortError):
            outcome["code"] = context.code() or grpc.StatusCode.UNKNOWN
            raise exc
        code, message = _status(exc)
        if not isinstance(exc, ServiceError):
            log.exception("%s failed", method)
        outcome["code"] = code
        await context.abort(code, message)


LIVENESS = "omrl.live"
"""Health service name that is SERVING from start to shutdown whatever `serving()` says: for liveness and
startup probes (a rollout server waiting for weights is alive, not ready: restarting it would not help)."""


class _Recorder:
    """Passed to `add_servicers` in place of the server, to learn the service names for health."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server
        self.services: list[str] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        for handler in handlers:
            name = getattr(handler, "service_name", lambda: None)()
            if name and name not in self.services:
                self.services.append(name)
        self._server.add_generic_rpc_handlers(handlers)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._server, attr)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _set_health(health: HealthServicer, services: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in services:
        await health.set(service, status)


async def _mirror_health(
    health: HealthServicer, services: list[str], serving: Callable[[], bool], last: bool, poll_s: float = 0.2
) -> None:
    while True:
        await asyncio.sleep(poll_s)
        now = bool(serving())
        if now != last:
            await _set_health(health, services, now)
            last = now


async def serve(
    name: str,
    port: int,
    add_servicers: list[AddServicer],
    *,
    host: str | None = None,
    metrics_port: int | None = None,
    grace_s: float = 5.0,
    on_shutdown: Callable | None = None,
    stop: asyncio.Event | None = None,
    ready: Callable[[int], Any] | None = None,
    max_message_bytes: int = 64 * 2**20,
    serving: Callable[[], bool] | None = None,
) -> None:
    """Runs a gRPC server until SIGTERM/SIGINT (or `stop` is set), then shuts down gracefully: health
    NOT_SERVING, no new calls, in-flight calls get `grace_s`, then `on_shutdown` (sync or async) runs.
    `ready(bound_port)` is called once serving. `host` defaults to `bind_host()`; the metrics endpoint
    binds the same host. `serving()`, when given, is mirrored into health (polled) while running."""
    host = bind_host(host)
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(name)],
        options=[
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it silently
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    recorder = _Recorder(server)
    for add in add_servicers:
        add(recorder)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(_hostport(host, port))
    if not bound:
        raise RuntimeError(f"{name}: could not bind {_hostport(host, port)}")

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)

    http = mirror = None
    try:
        if metrics_port is not None:
            from prometheus_client import start_http_server

            http, _ = start_http_server(metrics_port, addr=host)
            print(f"{name} metrics on {_hostport(host, http.server_address[1])}", file=sys.stderr, flush=True)
        await server.start()
        services = ["", *recorder.services]
        initially = serving is None or bool(serving())
        await _set_health(health, services, initially)
        await _set_health(health, [LIVENESS], True)
        if serving is not None:
            mirror = asyncio.create_task(_mirror_health(health, services, serving, initially))
        print(f"{name} listening on {_hostport(host, bound)}", file=sys.stderr, flush=True)
        if ready is not None:
            ready(bound)
        await stop.wait()
    finally:
        log.info("%s shutting down (grace %.1fs)", name, grace_s)
        if mirror is not None:
            mirror.cancel()
        await health.enter_graceful_shutdown()
        await server.stop(grace_s)
        for sig in handled:
            loop.remove_signal_handler(sig)
        if http is not None:
            http.shutdown()
        if on_shutdown is not None:
            result = on_shutdown()
            if inspect.isawaitable(result):
                await result


async def wait_for_health(address: str, timeout_s: float, service: str = "") -> None:
    """Polls the standard health check until `service` ("" is the whole server) is SERVING."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{address} not healthy after {timeout_s:.1f}s (last: {last})")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=min(1.0, remaining))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as err:
                last = err.code().name
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on now, for a server that binds it later (the local launcher hands ports
    to services that bind them after loading a model). Drawn at random below the kernel's ephemeral range
    (`ip_local_port_range`): the ports other processes get from a bind to port 0 or for an outgoing
    connection come from that range, so none of them can take it in the meantime (with the kernel's own
    pick, another process's vLLM engine or connection did, one start in a few on a busy machine: "Address
    already in use"). Never the same port twice in one process: a caller that draws several before binding any
    (the launcher draws a run's seven at once) would otherwise get one port twice, about one run in 600; the last
    1,024 are remembered. The kernel's pick where no such range is known or every draw is taken."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64):
        if low <= _PICK_FROM:
            break
        port = draw.randrange(_PICK_FROM, low)
        if port in _RESERVED_PORTS or port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        with _handed_out_lock:
            if port in _handed_out:
                continue
            _handed_out[port] = None
            if len(_handed_out) > _REMEMBERED:  # a long-lived job API: the oldest were bound long ago
                del _handed_out[next(iter(_handed_out))]
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


_PICK_FROM = 16384
_RESERVED_PORTS = frozenset({29600})  # the `nccl` weight push's rendezvous port (learner.weight_nccl_port)
_REMEMBERED = 1024
_handed_out: dict[int, None] = {}  # in the order handed out
_handed_out_lock = threading.Lock()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), 0 where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
