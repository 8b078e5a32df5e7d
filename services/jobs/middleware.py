"""ASGI middleware: request body size and nesting limits, and request latency metrics."""

from __future__ import annotations

import json
import re
import time
from itertools import accumulate

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
        await _answer(send, status, detail)


# a JSON string from its opening quote to its closing one (or the end of an unterminated one): the first
# greedy path always matches, so the scan never backtracks and stays linear in the body's length
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.?[^"\\]*)*(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_DEPTH_STEP = [0] * 256
_DEPTH_STEP[ord("[")] = _DEPTH_STEP[ord("{")] = 1
_DEPTH_STEP[ord("]")] = _DEPTH_STEP[ord("}")] = -1


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in `body` (a top-level object is 1), brackets inside strings not
    counted; any bytes are accepted (what is not JSON is measured as if it were)."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    return max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


class JsonDepthLimit:
    """400 for request bodies whose JSON nests deeper than `max_depth` levels, before anything parses them:
    Python's JSON parser, validation and the error handler each recurse once per level, and a body a few
    hundred levels deep was a 500 that also reset the keep-alive connection. The body is read whole first
    (BodySizeLimit, outside this, bounds it), so the answer leaves the connection usable."""

    def __init__(self, app, max_depth: int):
        self.app, self.max_depth = app, max_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left, or BodySizeLimit has answered 413
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        # at most as deep as it has opening brackets: the common small body skips the scan
        if body.count(b"[") + body.count(b"{") > self.max_depth and json_depth(body) > self.max_depth:
            return await _answer(send, 400, f"request body: JSON nested deeper than {self.max_depth} levels")
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: a disconnect, which streaming responses wait for
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _answer(send, status: int, detail: str) -> None:
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
