"""The task range of a server that indexes a fixed list it loaded with the task (ALFWorld's games),
found at start-up where no `task_range` is configured: on one environment, resets at 0, 1, 2, 4, ...
until the server rejects the index, then a binary search for the first rejected one. One probe per
process and server set; a failed probe leaves the range unknown (rejections at reset still apply)."""

from __future__ import annotations

import logging
import threading

from services.common.errors import ServiceError
from services.envs.agentgym.profiles import Profile
from services.envs.agentgym.servers import ErrorReply, Server

log = logging.getLogger(__name__)
UNBOUNDED_AT = 1 << 20
"""A server that still serves this index serves any: the range is left unknown."""

_PROBED: dict[str, range | None] = {}
_LOCK = threading.Lock()


def probed_range(key: str, server: Server, profile: Profile) -> range | None:
    """The range served, probed on `server` the first time `key` (the family and its servers) is asked."""
    with _LOCK:
        if key not in _PROBED:
            _PROBED[key] = _probe(server, profile)
        return _PROBED[key]


def known_range(key: str) -> range | None:
    """The range probed for `key` so far, without probing (for a reset, inside a caller's deadline)."""
    return _PROBED.get(key)


def _probe(server: Server, profile: Profile) -> range | None:
    p = profile
    before = server.before_create()
    try:
        created = server.call("POST", p.route("create"), "create (task range probe)")
        remote_id = created["id"] if isinstance(created, dict) else created
    except (ServiceError, KeyError, TypeError) as exc:
        log.warning("AgentGym %s server %s: task range not probed (%s); set task_range", p.family, server.url, exc)
        return None
    epoch = server.note_created(remote_id, before)
    server.count_live(+1)
    resets = 0

    def serves(task: int) -> bool:
        nonlocal resets
        resets += 1
        body = {p.id_field: remote_id, p.task_field: task, **p.reset_extra}
        try:
            server.call(
                "POST", p.route("reset"), f"reset env {remote_id}, task {task} (range probe)", epoch=epoch, json=body
            )
        except ErrorReply as exc:
            if p.rejects_task(exc.text):
                return False
            raise
        return True

    try:
        if not serves(0):
            raise ServiceError("task 0 is rejected")
        served, rejected = 0, 1
        while serves(rejected):
            served, rejected = rejected, rejected * 2
            if rejected > UNBOUNDED_AT:
                log.info("AgentGym %s server %s serves task %d: any task index is taken", p.family, server.url, served)
                return None
        while rejected - served > 1:
            middle = (served + rejected) // 2
            served, rejected = (middle, rejected) if serves(middle) else (served, middle)
    except ServiceError as exc:
        log.warning("AgentGym %s server %s: task range probe failed (%s); set task_range", p.family, server.url, exc)
        return None
    finally:
        if profile.has_close:
            server.close_env(profile.route("close"), remote_id, epoch)
    log.info("AgentGym %s server %s serves tasks 0..%d (probed in %d resets)", p.family, server.url, served, resets)
    return range(0, rejected)
