"""HTTP to AgentGym servers: calls with a deadline and typed failures, and the pool of servers of one
family that episodes are pinned to (and that recycles servers which cannot free environments)."""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.common.errors import DeadlineExceeded, Internal, InvalidArgument, ResourceExhausted, Unavailable

log = logging.getLogger(__name__)
DOWN_S = 10.0
"""How long a server that failed to answer is passed over by new episodes."""


class ErrorReply(Internal):
    """The server answered HTTP 200 with {"error": ...}: the call failed inside the server."""


@dataclass(eq=False)
class Server:
    url: str
    client: httpx.Client
    open: int = 0
    """Episodes pinned here and not yet released."""
    created: int = 0
    """Environments created since the server (re)started."""
    draining: bool = False
    """Out of rotation until recycled."""
    down_until: float = 0.0
    """Skipped by new episodes until then: it just failed to answer (killed, restarting)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call(self, method: str, route: str, what: str, **kwargs: Any) -> Any:
        """One HTTP call; every failure is a typed error naming the server and the route."""
        where = f"AgentGym {self.url}{route}"
        try:
            reply = self.client.request(method, route, **kwargs)
        except httpx.TimeoutException as exc:
            raise DeadlineExceeded(f"{where}: no reply within {self.client.timeout.read}s ({what})") from exc
        except httpx.TransportError as exc:  # refused, reset, closed mid-reply: the server is gone
            self.down_until = time.monotonic() + DOWN_S
            raise Unavailable(f"{where}: {type(exc).__name__}: {exc} ({what})") from exc
        if reply.status_code in (404, 405, 422):
            raise InvalidArgument(
                f"{where}: HTTP {reply.status_code} {reply.text[:200]!r}; is this a server of the configured family?"
            )
        if reply.status_code >= 500:
            raise (Internal if reply.status_code == 500 else Unavailable)(
                f"{where}: HTTP {reply.status_code} {reply.text[:200]!r} ({what})"
            )
        if reply.status_code != 200:
            raise Internal(f"{where}: HTTP {reply.status_code} {reply.text[:200]!r} ({what})")
        try:
            body = reply.json()
        except ValueError:
            raise Internal(f"{where}: reply is not JSON: {reply.text[:200]!r}") from None
        if isinstance(body, dict) and body.get("error") is not None:
            raise ErrorReply(f"{where}: error reply: {str(body['error'])[:500]} ({what})")
        return body


class ServerPool:
    """The servers of one family. A new episode goes to the server with the fewest open episodes and
    stays there. A server that cannot free environments (no close call, WebShop) is taken out of
    rotation after `recycle_after` creations, and once its last episode ends `recycle_command` runs
    (e.g. a restart of its container) and the pool waits for `GET /` before using it again."""

    def __init__(
        self,
        urls: list[str],
        timeout_s: float,
        recycle_after: int | None = None,
        recycle_command: str | None = None,
        recycle_wait_s: float = 120.0,
        id_reuse_after: int | None = None,
    ):
        self.servers = [
            Server(url.rstrip("/"), httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)) for url in urls
        ]
        self.recycle_after, self.recycle_command, self.recycle_wait_s = recycle_after, recycle_command, recycle_wait_s
        self.id_reuse_after = id_reuse_after
        self.recycles = 0
        self._lock = threading.Lock()

    def acquire(self) -> Server:
        with self._lock:
            usable = [s for s in self.servers if not s.draining]
            now = time.monotonic()
            usable = [s for s in usable if s.down_until <= now] or usable  # all down: try anyway
            if not usable:
                raise ResourceExhausted(
                    "every AgentGym server is out of rotation (recycling, or out of ids with no "
                    "recycle_command): " + ", ".join(s.url for s in self.servers)
                )
            server = min(usable, key=lambda s: s.open)
            server.open += 1
            server.created += 1
            limit = self.recycle_after if self.recycle_command else self.id_reuse_after
            if limit is not None and server.created >= limit:
                server.draining = True
                log.warning(
                    "AgentGym server %s created %d environments: out of rotation%s",
                    server.url,
                    server.created,
                    " until recycled"
                    if self.recycle_command
                    else " for good (its ids would repeat; set recycle_command)",
                )
            return server

    def release(self, server: Server) -> None:
        with self._lock:
            server.open -= 1
            recycle = server.draining and server.open == 0 and self.recycle_command is not None
        if recycle:
            threading.Thread(target=self.recycle, args=(server,), name=f"recycle {server.url}", daemon=True).start()

    def recycle(self, server: Server) -> bool:
        command = self.recycle_command.format(url=server.url, port=server.url.rsplit(":", 1)[-1])
        log.info("recycling AgentGym server %s: %s", server.url, command)
        try:
            subprocess.run(shlex.split(command), check=True, timeout=self.recycle_wait_s, capture_output=True)
        except (subprocess.SubprocessError, OSError) as exc:
            log.error("recycle command for %s failed: %s; the server stays out of rotation", server.url, exc)
            return False
        deadline = time.monotonic() + self.recycle_wait_s
        while time.monotonic() < deadline:
            try:
                if server.client.get("/").status_code == 200:
                    with self._lock:
                        server.created, server.draining = 0, False
                        self.recycles += 1
                    log.info("AgentGym server %s is back after recycling", server.url)
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        log.error("AgentGym server %s did not answer GET / within %.0fs of recycling", server.url, self.recycle_wait_s)
        return False

    def close(self) -> None:
        for server in self.servers:
            server.client.close()
