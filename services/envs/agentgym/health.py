"""The health watch of one server pool: a thread that asks every server `GET /` each `every_s` and retries the
closes that failed. It sees what no episode call shows on its own:

- a restart: a refused connection means the process is gone, so environments created before are lost even if
  the server is back before their next call (Server.refused); a restart quicker than `every_s` shows instead
  as a create whose id goes back (Server.note_created);
- a server whose worker threads are all busy or stuck (hung calls hold one each): `GET /` unanswered for
  `stuck_after_s` takes it out of rotation, reported, until it answers again; with a `recycle_command` it is
  restarted at once.

`GET /` is sent besides the server's `max_concurrent` call slots, on the same connection pool."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import httpx

from services.envs.alerts import alert

log = logging.getLogger(__name__)


class HealthWatch:
    def __init__(self, pool: Any, every_s: float, timeout_s: float, stuck_after_s: float):
        """`pool`: the ServerPool watched (not imported here: the pool starts its watch)."""
        self.pool, self.every_s, self.timeout_s, self.stuck_after_s = pool, every_s, timeout_s, stuck_after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentgym health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for server in self.pool.servers:
                if self._stop.is_set():
                    return
                try:
                    self.probe(server)
                    self.pool.retry_closes(server)
                except Exception:  # noqa: BLE001 - the watch must outlive one bad round
                    log.exception("AgentGym health watch of %s failed; it goes on", server.url)

    def probe(self, server: Any) -> None:
        if server.draining and self.pool.recycle_command:
            return  # its recycler waits for GET / itself
        try:
            server.client.get("/", timeout=self.timeout_s)
        except httpx.ConnectError as exc:
            server.refused(str(exc))
        except httpx.TimeoutException:
            why = server.unanswered(time.monotonic(), self.stuck_after_s)
            if why:
                message = f"AgentGym {server.family} server {server.url} is out of rotation: {why}"
                log.error("%s", message)
                alert("env_server_out_of_rotation", message, family=server.family, server=server.url)
                self.pool.recycle_stuck(server)
        except httpx.HTTPError:
            return  # reset mid-reply: the next round tells
        else:
            server.answered()
