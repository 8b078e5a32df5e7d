"""ASGI middleware: request body size limit and request latency metrics."""

from __future__ import annotations

import json
import time

from prometheus_client import Histogram


class BodySizeLimit:
    """413 for request bodies over `max_bytes`, whether announced by Content-Length or streamed."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._reject(send, 413 if length.isdigit() else 400)
        received, rejected, started = 0, False, False

        async def limited_receive():
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request" and not started:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # answer now; to the app the client has gone (frameworks turn raised errors into a 400)
                    rejected = True
                    await self._reject(send, 413)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            nonlocal started
            if rejected:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, send, status: int) -> None:
        detail = (
            f"request body larger than {self.max_bytes} bytes" if status == 413 else "invalid Content-Length header"
        )
        body = json.dumps({"detail": detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class RequestMetrics:
    """Latency of every request by method, route template (not the raw path) and status."""

    def __init__(self, app, histogram: Histogram):
        self.app, self.histogram = app, histogram

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500

        async def recording_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route = scope.get("route")
            self.histogram.labels(scope["method"], getattr(route, "path", "unmatched"), str(status)).observe(
                time.perf_counter() - start
            )
