"""HTTP to AgentGym servers: calls with a deadline and typed failures, at most `max_concurrent` at once per
server (the rest queue here, not in the server, which slows down under concurrency), and the pool of
servers of one family that episodes are pinned to (and that recycles servers which cannot free
environments)."""

from __future__ import annotations

import logging
import shlex
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.common import metrics
from services.common.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from services.envs.base import call_time_left

log = logging.getLogger(__name__)
DOWN_S = 10.0
"""How long a server that failed to answer is passed over by new episodes."""
MARGIN_S = 0.5
"""A call ends this long before its caller's deadline, so the caller gets our typed error, not its own."""
MIN_CALL_S = 0.2
"""Less time than this left after queueing: fail at once rather than send a call that cannot finish."""

REMOTE_OPEN = metrics.gauge(
    "envs",
    "agentgym_open_envs",
    "Environments this service created on an AgentGym server "
    "and has not closed (families without /close: all since the server's last restart)",
    ["family", "server"],
)
QUEUED = metrics.gauge(
    "envs", "agentgym_queued_calls", "Calls waiting for a free slot on an AgentGym server", ["family", "server"]
)
QUEUE_WAIT = metrics.histogram(
    "envs",
    "agentgym_queue_wait_seconds",
    "Time a call waited for a free slot on an AgentGym server (failed waits included)",
    ["family", "server"],
)


class FifoSlots:
    """`n` slots handed out in arrival order. threading.Semaphore lets a newcomer take a slot ahead of a
    woken waiter, who then queues again at the back; in order, a call waits at most
    ceil(queued / n) call times, what the scaled env-call deadline (services.envs.deadlines) counts on."""

    def __init__(self, n: int):
        self._free = n
        self._waiters: deque[threading.Event] = deque()
        self._lock = threading.Lock()

    def acquire(self, timeout: float | None = None) -> bool:
        with self._lock:
            if self._free and not self._waiters:
                self._free -= 1
                return True
            turn = threading.Event()
            self._waiters.append(turn)
        if turn.wait(timeout):
            return True
        with self._lock:
            if turn.is_set():  # handed a slot as the wait ran out
                return True
            self._waiters.remove(turn)
            return False

    def release(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()  # the slot passes straight to the first waiter
            else:
                self._free += 1


class ErrorReply(Internal):
    """The server answered HTTP 200 with {"error": ...}: the call failed inside the server."""

    def __init__(self, message: str, text: str = ""):
        super().__init__(message)
        self.text = text
        """The server's own error text (may be empty: maze's failed assertion)."""


def no_reply(message: str, full_wait: bool) -> DeadlineExceeded:
    """No reply in time. `full_wait`: the server had the whole `timeout_s` (not a budget cut short by
    queueing), so it really did not answer."""
    exc = DeadlineExceeded(message)
    exc.full_wait = full_wait
    return exc


@dataclass(eq=False)
class Server:
    url: str
    client: httpx.Client
    family: str = ""
    max_concurrent: int = 8
    open: int = 0
    """Episodes pinned here and not yet released."""
    created: int = 0
    """Environments created since the server (re)started."""
    draining: bool = False
    """Out of rotation until recycled."""
    down_until: float = 0.0
    """Skipped by new episodes until then: it just failed to answer (killed, restarting)."""
    live: int = 0
    """Environments created here and not closed (without /close: every one since the last restart)."""
    close_missing: bool = False
    """/close answered 404/405 once: the server has none, so it is not called again."""
    close_checked: bool = False
    """/close has answered once (either way); until then closes go one at a time (see `close_probe`)."""
    close_probe: threading.Lock = field(default_factory=threading.Lock)
    lock: threading.Lock = field(default_factory=threading.Lock)
    slots: FifoSlots = field(init=False)

    def __post_init__(self) -> None:
        self.slots = FifoSlots(self.max_concurrent)
        self._open_gauge = REMOTE_OPEN.labels(self.family, self.url)
        self._queued_gauge = QUEUED.labels(self.family, self.url)
        self._queue_wait = QUEUE_WAIT.labels(self.family, self.url)

    def count_live(self, change: int) -> None:
        with self.lock:
            self.live = max(0, self.live + change)
            self._open_gauge.set(self.live)

    def close_env(self, route: str, remote_id: Any) -> None:
        """POSTs `route` (the family's /close) for one environment. A 404/405 means this server has no /close
        after all: it is never called again; another failure is logged and left (the reaper retries)."""
        if self.close_missing:
            return
        try:
            self.call("POST", route, f"close env {remote_id}", json={"id": remote_id})
            self.count_live(-1)
        except InvalidArgument as exc:
            self.close_missing = True
            log.warning(
                "AgentGym %s server %s has no /close (%s); its environments stay open until it restarts",
                self.family,
                self.url,
                exc,
            )
        except ServiceError as exc:
            log.info("closing AgentGym env %s on %s failed: %s", remote_id, self.url, exc)
            return
        self.close_checked = True

    def call(self, method: str, route: str, what: str, **kwargs: Any) -> Any:
        """One HTTP call, once one of the server's `max_concurrent` slots is free and within the
        caller's deadline; every failure is a typed error naming the server and the route."""
        where = f"AgentGym {self.url}{route}"
        left = call_time_left()
        self._queued_gauge.inc()
        start = time.perf_counter()
        try:
            got = self.slots.acquire(timeout=max(0.0, left - MARGIN_S - MIN_CALL_S) if left is not None else None)
        finally:
            self._queued_gauge.dec()
            self._queue_wait.observe(time.perf_counter() - start)
        if not got:
            raise no_reply(
                f"{where}: no free slot within {left:.1f}s ({self.max_concurrent} calls in flight; {what})",
                full_wait=False,
            )
        try:
            return self._send(method, route, what, where, **kwargs)
        finally:
            self.slots.release()

    def _send(self, method: str, route: str, what: str, where: str, **kwargs: Any) -> Any:
        full = self.client.timeout.read
        left = call_time_left()
        budget = full if left is None else min(full, left - MARGIN_S)
        if budget < MIN_CALL_S:
            raise no_reply(f"{where}: the caller's deadline passed while the call queued ({what})", full_wait=False)
        start = time.perf_counter()
        try:
            reply = self.client.request(method, route, timeout=budget, **kwargs)
        except httpx.TimeoutException as exc:
            raise no_reply(f"{where}: no reply within {budget:.3g}s ({what})", full_wait=budget >= full) from exc
        except httpx.TransportError as exc:  # refused, reset, closed mid-reply: the server is gone
            self.down_until = time.monotonic() + DOWN_S
            raise Unavailable(f"{where}: {type(exc).__name__}: {exc} ({what})") from exc
        log.debug(
            "%s %s%s (%s): HTTP %d in %.3fs",
            method,
            self.url,
            route,
            what,
            reply.status_code,
            time.perf_counter() - start,
        )
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
            raise ErrorReply(f"{where}: error reply: {str(body['error'])[:500]} ({what})", str(body["error"]))
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
        family: str = "",
        max_concurrent: int = 8,
    ):
        # the connection pool holds every slot's connection, so no call waits inside httpx
        limits = httpx.Limits(max_connections=max_concurrent + 2, max_keepalive_connections=max_concurrent + 2)
        self.servers = [
            Server(
                url.rstrip("/"),
                httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, limits=limits),
                family,
                max_concurrent,
            )
            for url in urls
        ]
        self.recycle_after, self.recycle_command, self.recycle_wait_s = recycle_after, recycle_command, recycle_wait_s
        self.id_reuse_after = id_reuse_after
        self.recycles = 0
        self._reset_timeouts: dict[int, int] = {}
        self._lock = threading.Lock()

    def reset_timed_out(self, task_index: int) -> int:
        """Counts a reset of this task that ran out of time after queueing; returns how many so far."""
        with self._lock:
            self._reset_timeouts[task_index] = self._reset_timeouts.get(task_index, 0) + 1
            return self._reset_timeouts[task_index]

    def reset_answered(self, task_index: int) -> None:
        with self._lock:
            self._reset_timeouts.pop(task_index, None)

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
        log.warning("recycling AgentGym server %s: %s", server.url, command)
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
                    server.count_live(-server.live)  # a restarted server holds no environment
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
