"""The check of AgentGym servers before a run starts (`AgentGymEnv.preflight`), so that a server that is
down or of another family ends the launch in seconds with one line, instead of a learner step timing out
minutes later. Each configured server must answer `GET /`, answer the family's create in the family's
shape (an object with "id"; WebShop: a bare integer) and, where the family has /close, close that
environment again; a server without /close is not faulted for it (the adapter copes).

Every call has a short deadline (`timeout_s`, at most CHECK_TIMEOUT_S) on a client of its own: the
adapter's server pool counts open episodes and queues calls, which a check must not touch. A failure
names the server, the route and what it answered; an answer that no retry can change (HTTP 501, a reply
that is not JSON, a server of another family) is called not retryable."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from services.envs.agentgym.profiles import PROFILES, Profile
from services.envs.base import InvalidTask

log = logging.getLogger(__name__)
CHECK_TIMEOUT_S = 5.0
"""The longest one check call waits (the option `timeout_s` where that is shorter)."""
BODY_CHARS = 120
"""How much of an answer's body a failure quotes."""
WRONG_FAMILY = (404, 405, 422)
"""What a FastAPI server answers for a route it does not have, or a body it does not take."""


class CheckFailed(Exception):
    """One server's check failed; the message is the part of the line after the server's URL."""


def check_servers(family: str, urls: list[str], timeout_s: float) -> str:
    """Checks every server (at once); returns the line a launcher shows, or raises InvalidTask with one
    line naming the first server (in configured order) that failed."""
    profile, timeout = PROFILES[family], min(timeout_s, CHECK_TIMEOUT_S)
    if not urls:
        raise InvalidTask(f"AgentGym {family}: base_url names no server")
    with ThreadPoolExecutor(max_workers=min(len(urls), 16), thread_name_prefix="agentgym check") as pool:
        outcomes = list(pool.map(lambda url: _outcome(url, profile, timeout), urls))
    failed = [(url, why) for url, why in zip(urls, outcomes) if why is not None]
    if failed:
        url, why = failed[0]
        more = f" (and {len(failed) - 1} more of {len(urls)} servers)" if len(failed) > 1 else ""
        raise InvalidTask(f"AgentGym {family} server {url}: {why}{more}")
    return f"env servers: {', '.join(urls)} ({family}) ok"


def _outcome(url: str, profile: Profile, timeout: float) -> str | None:
    try:
        check_server(url, profile, timeout)
    except CheckFailed as exc:
        return str(exc)
    return None


def check_server(url: str, profile: Profile, timeout: float) -> None:
    """GET /, create, and close where the family has /close; raises CheckFailed saying what went wrong."""
    p = profile
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout) as client:
        root = _send(client, "GET", "/")
        if root.status_code != 200:
            raise CheckFailed(_answered("GET", "/", root, _status_note(root.status_code, "not an AgentGym server")))
        reply = _send(client, "POST", p.route("create"), json=p.create_body)
        remote_id = _created_id(_json(reply, "POST", p.route("create"), p), reply, p)
        if p.has_close:
            _close(client, p, remote_id)


def _send(client: httpx.Client, method: str, route: str, **kwargs: Any) -> httpx.Response:
    try:
        return client.request(method, route, **kwargs)
    except httpx.TimeoutException:
        raise CheckFailed(f"{method} {route}: no answer within {client.timeout.read:.3g}s") from None
    except httpx.HTTPError as exc:  # refused, reset, a name that does not resolve
        why = " ".join(str(exc).split()) or "no answer"
        raise CheckFailed(f"{method} {route}: {type(exc).__name__}: {why}") from None


def _json(reply: httpx.Response, method: str, route: str, profile: Profile) -> Any:
    """The body of a call that must answer the family's JSON; else CheckFailed."""
    if reply.status_code != 200:
        note = _status_note(reply.status_code, f"not a {profile.family} server: wrong family")
        raise CheckFailed(_answered(method, route, reply, note))
    try:
        body = reply.json()
    except ValueError:
        raise CheckFailed(_answered(method, route, reply, "not JSON; not retryable")) from None
    if isinstance(body, dict) and body.get("error") is not None:
        raise CheckFailed(f"{method} {route} answered an error: {_quote(str(body['error']))}")
    return body


def _created_id(created: Any, reply: httpx.Response, profile: Profile) -> int:
    """The new environment's id, checked against the family's create shape."""
    if profile.create_returns == "bare":
        remote_id, shape = created, "a bare integer id"
    else:
        remote_id, shape = created.get("id") if isinstance(created, dict) else None, 'an object with "id"'
    if isinstance(remote_id, float) and remote_id.is_integer():
        remote_id = int(remote_id)
    if isinstance(remote_id, bool) or not isinstance(remote_id, int):
        raise CheckFailed(
            _answered(
                "POST",
                profile.route("create"),
                reply,
                f"not {shape}: not a {profile.family} server: wrong family; not retryable",
            )
        )
    return remote_id


def _close(client: httpx.Client, profile: Profile, remote_id: int) -> None:
    """Closes the checked environment. A close refused (false) for an environment never reset, which
    BabyAI keeps, is sent again after a reset of the family's first task; if that fails too the one
    environment stays."""
    route = profile.route("close")
    reply = _send(client, "POST", route, json={"id": remote_id})
    if reply.status_code in WRONG_FAMILY:
        return  # no /close on this server: the adapter finds out for itself and copes
    if _json(reply, "POST", route, profile) is not False:
        return
    first_task = profile.task_range[0] if profile.task_range else 0
    body = {profile.id_field: remote_id, profile.task_field: first_task, **profile.reset_extra}
    try:
        _json(_send(client, "POST", profile.route("reset"), json=body), "POST", profile.route("reset"), profile)
        _send(client, "POST", route, json={"id": remote_id})
    except CheckFailed as exc:
        log.info("AgentGym %s server %s: the checked environment stays open (%s)", profile.family, client.base_url, exc)


def _status_note(status: int, wrong: str) -> str:
    if status in WRONG_FAMILY:
        return f"{wrong}; not retryable"
    if status == 501:
        return "not implemented; not retryable"
    return "the server failed" if status >= 500 else "not what an AgentGym server answers"


def _answered(method: str, route: str, reply: httpx.Response, note: str) -> str:
    return f"{method} {route} answered HTTP {reply.status_code} {_quote(reply.text)} ({note})"


def _quote(text: str) -> str:
    """The start of a body, on one line."""
    return repr(text[:BODY_CHARS] + ("..." if len(text) > BODY_CHARS else ""))
