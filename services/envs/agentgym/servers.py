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
from collections.abc import Callable
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
from services.envs.agentgym.profiles import Profile
from services.envs.alerts import alert
from services.envs.base import call_time_left

log = logging.getLogger(__name__)
DOWN_S = 10.0
"""How long a server that failed to answer is passed over by new episodes."""
MARGIN_S = 0.5
"""A call ends this long before its caller's deadline, so the caller gets our typed error, not its own."""
MIN_CALL_S = 0.2
"""Less time than this left after queueing: fail at once rather than send a call that cannot finish."""
CLOSE_RETRY_S = 2.0
MAX_CLOSE_RETRY_S = 60.0
"""A failed or refused close is retried after 2 s, then twice as long each time, up to a minute."""
MAX_PENDING_CLOSES = 10_000

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
RESTARTS = metrics.counter(
    "envs",
    "agentgym_restarts_total",
    "Restarts of an AgentGym server seen by this process, by what showed it (ids: a create answered an id "
    "at or below one it had handed out; unreachable: a connection was refused; recycled: recycle_command)",
    ["family", "server", "signal"],
)
LOST = metrics.counter(
    "envs",
    "agentgym_episodes_lost_total",
    "Episode calls refused because the episode's environment was created before its server restarted",
    ["family", "server"],
)
STUCK = metrics.gauge(
    "envs",
    "agentgym_stuck_calls",
    "Calls given up with no reply in timeout_s since the server's last restart: the server may still be "
    "busy on each of them, holding one of its worker threads",
    ["family", "server"],
)
HEALTHY = metrics.gauge(
    "envs",
    "agentgym_server_healthy",
    "1 while an AgentGym server is in rotation, 0 while it is out (GET / unanswered, or recycling)",
    ["family", "server"],
)
PENDING_CLOSES = metrics.gauge(
    "envs",
    "agentgym_pending_closes",
    "Environments whose close failed or was refused, retried by the reaper",
    ["family", "server"],
)
CLOSE_FAILURES = metrics.counter(
    "envs",
    "agentgym_close_failures_total",
    "Closes that did not free an environment (refused: the server answered false; error: no answer)",
    ["family", "server", "reason"],
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


@dataclass
class PendingClose:
    epoch: int
    attempts: int = 0
    due: float = 0.0


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
    epoch: int = 0
    """Restarts of the server seen so far: an environment created in an earlier epoch is gone, and its id may
    now name another episode's environment, so no call for it is sent again."""
    max_id: int = -1
    """Highest id the server handed out in this epoch; every family counts ids up from 0 after a start."""
    unreachable: bool = False
    """A connection was refused and nothing has answered since (the restart is counted once)."""
    stuck: int = 0
    """Calls given up with no reply in the full timeout_s since the last restart."""
    unanswered_since: float | None = None
    """GET / has not answered since then (the health watch's probes time out)."""
    unhealthy: str = ""
    """Why the server is out of rotation until GET / answers again ("" while healthy)."""
    pending: dict[Any, PendingClose] = field(default_factory=dict)
    """Environments whose close failed or was refused: retried by the pool's reaper."""
    close_probe: threading.Lock = field(default_factory=threading.Lock)
    lock: threading.RLock = field(default_factory=threading.RLock)
    slots: FifoSlots = field(init=False)

    def __post_init__(self) -> None:
        self.slots = FifoSlots(self.max_concurrent)
        labels = (self.family, self.url)
        self._open_gauge, self._queued_gauge = REMOTE_OPEN.labels(*labels), QUEUED.labels(*labels)
        self._queue_wait, self._stuck_gauge = QUEUE_WAIT.labels(*labels), STUCK.labels(*labels)
        self._healthy_gauge, self._pending_gauge = HEALTHY.labels(*labels), PENDING_CLOSES.labels(*labels)
        self._lost = LOST.labels(*labels)
        self._healthy_gauge.set(1)

    def count_live(self, change: int) -> None:
        with self.lock:
            self.live = max(0, self.live + change)
            self._open_gauge.set(self.live)

    def restarted(self, signal: str, detail: str) -> None:
        """The server lost every environment: episodes created before fail at their next call, their closes
        are not sent (the ids may be another episode's by now), and its counts start again."""
        with self.lock:
            self.epoch += 1
            self.max_id, self.created, self.stuck = -1, 0, 0
            self.pending.clear()
            self.count_live(-self.live)
            self._stuck_gauge.set(0)
            self._pending_gauge.set(0)
        RESTARTS.labels(self.family, self.url, signal).inc()
        message = (
            f"AgentGym {self.family} server {self.url} restarted ({detail}): every episode created on it before is lost"
        )
        log.warning("%s", message)
        alert("env_server_restarted", message, family=self.family, server=self.url, signal=signal)

    def before_create(self) -> tuple[int, int]:
        """(epoch, highest id seen) just before a create is sent: the server's id counter only goes up, so
        unless it restarted, the create answers an id above that."""
        with self.lock:
            return self.epoch, self.max_id

    def note_created(self, remote_id: Any, before: tuple[int, int]) -> int:
        """Records an id the server handed out to a create sent at `before` (before_create); returns the
        epoch its environment belongs to: an id at or below one seen before the create was sent means the
        server restarted (ids of concurrent creates may come back in any order). A create that overlapped a
        restart seen some other way keeps the old epoch: it may have reached either process."""
        epoch, floor = before
        with self.lock:
            if epoch != self.epoch:
                return epoch
            if isinstance(remote_id, int) and not isinstance(remote_id, bool):
                if remote_id <= floor:
                    self.restarted("ids", f"a create answered id {remote_id}; id {floor} was handed out before it")
                self.max_id = max(self.max_id, remote_id)
            return self.epoch

    def check_epoch(self, epoch: int | None, what: str, count: bool = True) -> None:
        if epoch is None or epoch == self.epoch:
            return
        if count:
            self._lost.inc()
        raise Unavailable(
            f"AgentGym {self.family} server {self.url} restarted after this episode's environment was created; "
            f"the environment is gone and its id may be another's, so nothing more is sent for it ({what})"
        )

    def answered(self) -> None:
        """Something answered: the server is up, and reachable again after a refused connection."""
        with self.lock:
            self.unreachable, self.unanswered_since, self.down_until = False, None, 0.0
            if self.unhealthy:
                message = f"AgentGym {self.family} server {self.url} answers again: back in rotation"
                log.warning("%s", message)
                alert("env_server_back", message, family=self.family, server=self.url)
                self.unhealthy = ""
                self._healthy_gauge.set(0 if self.draining else 1)

    def refused(self, detail: str) -> None:
        """Nothing listens at the address: the process is gone, and whatever answers next is a new one."""
        with self.lock:
            self.down_until = time.monotonic() + DOWN_S
            first = not self.unreachable
            self.unreachable = True
        if first:
            self.restarted("unreachable", f"connection refused: {detail}")

    def unanswered(self, now: float, stuck_after_s: float) -> str:
        """GET / timed out; past `stuck_after_s` of that the server leaves the rotation. Returns the new
        reason when it just left, else ""."""
        with self.lock:
            if self.unanswered_since is None:
                self.unanswered_since = now
            if self.unhealthy or now - self.unanswered_since < stuck_after_s:
                return ""
            self.unhealthy = (
                f"GET / unanswered for {now - self.unanswered_since:.0f}s; {self.stuck} call(s) given up with no "
                f"reply since its last restart (its worker threads are all busy or stuck)"
            )
            self._healthy_gauge.set(0)
            return self.unhealthy

    def close_env(self, route: str, remote_id: Any, epoch: int | None = None, body: dict | None = None) -> bool:
        """POSTs `route` (the family's /close) for one environment; True once the server confirmed it. A
        404/405/501 means this server has no /close after all: it is never called again. A failed or refused
        close is kept for the pool's reaper to retry (`pending`); one of an earlier epoch is not sent at all."""
        if self.close_missing:
            return False
        try:
            self.check_epoch(epoch, f"close env {remote_id}", count=False)
            confirmed = self.call(
                "POST", route, f"close env {remote_id}", epoch=epoch, json=body or {"id": remote_id}, close=True
            )
        except InvalidArgument as exc:
            self.close_missing = True
            log.warning(
                "AgentGym %s server %s has no /close (%s); its environments stay open until it restarts",
                self.family,
                self.url,
                exc,
            )
            return False
        except ServiceError as exc:
            if epoch is not None and epoch != self.epoch:
                return False  # it restarted: nothing of that epoch is left to close
            self.close_checked = True
            self._close_later(remote_id, epoch, "error", exc)
            return False
        self.close_checked = True
        if confirmed is False:
            self._close_later(remote_id, epoch, "refused", "the server answered false")
            return False
        with self.lock:
            if self.pending.pop(remote_id, None) is not None:
                self._pending_gauge.set(len(self.pending))
        self.count_live(-1)
        return True

    def _close_later(self, remote_id: Any, epoch: int | None, reason: str, why: Any) -> None:
        CLOSE_FAILURES.labels(self.family, self.url, reason).inc()
        with self.lock:
            if epoch is not None and epoch != self.epoch:
                return
            entry = self.pending.setdefault(remote_id, PendingClose(self.epoch if epoch is None else epoch))
            entry.attempts += 1
            entry.due = time.monotonic() + min(CLOSE_RETRY_S * 2 ** (entry.attempts - 1), MAX_CLOSE_RETRY_S)
            while len(self.pending) > MAX_PENDING_CLOSES:  # a server refusing every close must not grow this forever
                dropped = next(iter(self.pending))
                del self.pending[dropped]
                log.warning("AgentGym %s server %s: close of env %s given up", self.family, self.url, dropped)
            self._pending_gauge.set(len(self.pending))
        log.info("closing AgentGym env %s on %s failed (%s: %s); retried later", remote_id, self.url, reason, why)

    def due_closes(self, now: float) -> list[tuple[Any, int]]:
        with self.lock:
            return [(remote_id, e.epoch) for remote_id, e in self.pending.items() if e.due <= now]

    def call(
        self, method: str, route: str, what: str, epoch: int | None = None, close: bool = False, **kwargs: Any
    ) -> Any:
        """One HTTP call, once one of the server's `max_concurrent` slots is free and within the
        caller's deadline; every failure is a typed error naming the server and the route. `epoch`: the
        epoch of the environment the call is for; checked again once the call has its slot."""
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
            self.check_epoch(epoch, what, count=not close)
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
            if budget >= full:
                with self.lock:
                    self.stuck += 1
                    self._stuck_gauge.set(self.stuck)
            raise no_reply(f"{where}: no reply within {budget:.3g}s ({what})", full_wait=budget >= full) from exc
        except httpx.ConnectError as exc:
            self.refused(str(exc))
            raise Unavailable(f"{where}: {type(exc).__name__}: {exc} ({what})") from exc
        except httpx.TransportError as exc:  # reset or closed mid-reply: the server may be gone
            self.down_until = time.monotonic() + DOWN_S
            raise Unavailable(f"{where}: {type(exc).__name__}: {exc} ({what})") from exc
        self.answered()
        log.debug(
            "%s %s%s (%s): HTTP %d in %.3fs",
            method,
            self.url,
            route,
            what,
            reply.status_code,
            time.perf_counter() - start,
        )
        if reply.status_code in (404, 405, 422, 501):
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
            raise InvalidArgument(
                f"{where}: reply is not JSON: {reply.text[:200]!r}; is this an AgentGym server? ({what})"
            ) from None
        if isinstance(body, dict) and body.get("error") is not None:
            raise ErrorReply(f"{where}: error reply: {str(body['error'])[:500]} ({what})", str(body["error"]))
        return body


class ServerPool:
    """The servers of one family. A new episode goes to the server with the fewest open episodes and
    stays there. A server that cannot free environments (no close call, WebShop) is taken out of
    rotation after `recycle_after` creations, and once its last episode ends `recycle_command` runs
    (e.g. a restart of its container) and the pool waits for `GET /` before using it again. With
    `health_every_s`, a HealthWatch (services.envs.agentgym.health) probes the servers and retries failed closes."""

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
        profile: Profile | None = None,
        tasks: Any = None,
        watch: Callable[[ServerPool], Any] | None = None,
    ):
        """`tasks`: the TaskGate of this server set (services.envs.agentgym.tasks); `watch`: starts the pool's
        HealthWatch (services.envs.agentgym.health), called at the first acquire."""
        # the connection pool holds every slot's connection and the health probe's, so no call waits inside httpx
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
        self.profile, self.tasks = profile, tasks
        self.recycles = 0
        self._lock = threading.Lock()
        self._start_watch, self._watch = watch, None

    def acquire(self) -> Server:
        if self._watch is None and self._start_watch is not None:
            with self._lock:
                if self._watch is None:
                    self._watch = self._start_watch(self)
        with self._lock:
            usable = [s for s in self.servers if not s.draining and not s.unhealthy]
            now = time.monotonic()
            usable = [s for s in usable if s.down_until <= now] or usable  # all down: try anyway
            if not usable:
                raise ResourceExhausted(
                    "every AgentGym server is out of rotation: "
                    + "; ".join(f"{s.url} ({self._why_out(s)})" for s in self.servers)
                )
            server = min(usable, key=lambda s: s.open)
            server.open += 1
            server.created += 1
            limit = self.recycle_after if self.recycle_command else self.id_reuse_after
            if limit is not None and server.created >= limit:
                server.draining = True
                server._healthy_gauge.set(0)
                log.warning(
                    "AgentGym server %s created %d environments: out of rotation%s",
                    server.url,
                    server.created,
                    " until recycled"
                    if self.recycle_command
                    else " for good (its ids would repeat; set recycle_command)",
                )
            return server

    def _why_out(self, server: Server) -> str:
        if server.unhealthy:
            return server.unhealthy
        return "recycling" if self.recycle_command else "out of ids, no recycle_command"

    def release(self, server: Server) -> None:
        with self._lock:
            server.open -= 1
            recycle = server.draining and server.open == 0 and self.recycle_command is not None
        if recycle:
            threading.Thread(target=self.recycle, args=(server,), name=f"recycle {server.url}", daemon=True).start()

    def recycle_stuck(self, server: Server) -> None:
        """A server out of rotation because GET / goes unanswered: restarted at once with `recycle_command`
        (its episodes are lost either way), else left out until it answers."""
        with self._lock:
            if self.recycle_command is None or server.draining:
                return
            server.draining = True
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
                    server.restarted("recycled", f"recycle_command ran: {command}")
                    with self._lock:
                        server.draining = False
                        self.recycles += 1
                    server.answered()
                    server._healthy_gauge.set(1)
                    log.info("AgentGym server %s is back after recycling", server.url)
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        log.error("AgentGym server %s did not answer GET / within %.0fs of recycling", server.url, self.recycle_wait_s)
        return False

    def retry_closes(self, server: Server) -> None:
        """Sends again the closes that failed or were refused and are due. A family whose server refuses to
        close an environment that was never reset (BabyAI answers false) gets it reset on a proven task first."""
        if self.profile is None or self.tasks is None or server.close_missing:
            return
        for remote_id, epoch in server.due_closes(time.monotonic()):
            if self.profile.close_needs_reset:
                task = self.tasks.proven_task()
                if task is None:
                    continue
                try:
                    body = {self.profile.id_field: remote_id, self.profile.task_field: task, **self.profile.reset_extra}
                    server.call(
                        "POST",
                        self.profile.route("reset"),
                        f"reset env {remote_id} to close it",
                        epoch=epoch,
                        close=True,
                        json=body,
                    )
                except ServiceError as exc:
                    log.info("AgentGym env %s on %s: reset before close failed: %s", remote_id, server.url, exc)
            server.close_env(self.profile.route("close"), remote_id, epoch, {self.profile.id_field: remote_id})

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        for server in self.servers:
            server.client.close()
