"""The job API's token in front of the inspector it mounts under /inspect/: the bearer header as for the API; a
browser, which cannot send that header from a link, brings `?token=` once and gets a cookie instead. Anything
else is 401."""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlencode

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

COOKIE = "omrl_inspect"


def cookie_value(token: str) -> str:
    # a keyed digest rather than the token itself: a cookie read off a browser opens the inspector, not the API
    return hmac.new(token.encode(), b"omrl-inspector-cookie", hashlib.sha256).hexdigest()


class TokenGate:
    def __init__(self, app: ASGIApp, token: str):
        self.app, self.token, self.cookie = app, token, cookie_value(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        offered = request.query_params.get("token")
        if offered is not None and _same(offered, self.token):
            await self._log_in(request)(scope, receive, send)
            return
        header = request.headers.get("authorization", "")
        scheme, _, credentials = header.partition(" ")
        if (scheme.lower() == "bearer" and _same(credentials, self.token)) or _same(
            request.cookies.get(COOKIE, ""), self.cookie
        ):
            await self.app(scope, receive, send)
            return
        response = PlainTextResponse(
            "401: missing or wrong token (send the API's bearer token, or open the page once with ?token=...)",
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _log_in(self, request: Request) -> RedirectResponse:
        """Sets the cookie and sends the browser to the same page without the token in its address (history)."""
        rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
        root = request.scope.get("root_path", "") or "/"
        target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE,
            self.cookie,
            path=root,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response


def _same(offered: str, expected: str) -> bool:
    return hmac.compare_digest(offered.encode(), expected.encode())
