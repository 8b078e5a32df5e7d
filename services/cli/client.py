"""A small client of the job API (httpx, every call with a timeout)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import connect_sse


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any):
        self.status, self.detail = status, detail
        super().__init__(f"HTTP {status}: {format_detail(detail)}")


def format_detail(detail: Any) -> str:
    """422 details as `field.path: message` lines, anything else as is."""
    if isinstance(detail, list):
        return "; ".join(f"{'.'.join(str(p) for p in d.get('loc', [])[1:]) or 'body'}: {d.get('msg')}" for d in detail)
    return str(detail)


class JobsClient:
    def __init__(
        self, base_url: str, token: str, timeout_s: float = 30.0, transport: httpx.BaseTransport | None = None
    ):
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            transport=transport,
        )

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail")
            except ValueError:
                detail = response.text
            raise ApiError(response.status_code, detail)
        return (
            response.json()
            if response.headers.get("content-type", "").startswith("application/json")
            else response.text
        )

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/jobs", json=spec)

    def list(self, states: list[str] | None = None, limit: int = 50) -> dict[str, Any]:
        return self._call("GET", "/v1/jobs", params={"state": states or [], "limit": limit})

    def get(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def events(self, job_id: str, after: int = 0) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/events", params={"after": after})

    def logs(self, job_id: str, service: str, tail: int) -> str:
        return self._call("GET", f"/v1/jobs/{job_id}/logs", params={"service": service, "tail": tail})

    def episodes(self, job_id: str, step: int | None) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{job_id}/episodes", params={} if step is None else {"step": step})

    def follow(self, job_id: str, after: int = 0, read_timeout_s: float = 60.0) -> Iterator[dict[str, Any]]:
        """Events as they happen (server-sent events, parsed by httpx-sse), ending with {"type": "end", ...}
        when the job has finished. The server pings every 15 s, so a read that waits longer than
        `read_timeout_s` means a dead link."""
        timeout = httpx.Timeout(read_timeout_s, connect=10.0)
        with connect_sse(
            self.http, "GET", f"/v1/jobs/{job_id}/events", params={"after": after, "follow": "true"}, timeout=timeout
        ) as source:
            if source.response.status_code >= 400:
                source.response.read()
                raise ApiError(source.response.status_code, source.response.json().get("detail"))
            for message in source.iter_sse():
                if not message.data:  # a ping (comment) after an event with an id reads as an empty message
                    continue
                if message.event == "end":
                    yield {"type": "end", **json.loads(message.data)}
                    return
                yield json.loads(message.data)
