"""Dependencies of every router but health: the bearer-token check, and no unknown query parameters."""

from __future__ import annotations

import secrets

from fastapi import Depends, HTTPException, Request
from fastapi.dependencies.utils import get_flat_dependant
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

bearer = HTTPBearer(auto_error=False, description="The API token (OMRL_API_TOKEN of the server).")


def require_token(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
    expected: bytes = request.app.state.token.encode()
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def forbid_unknown_query(request: Request) -> None:
    """422 for query parameters the route does not take: a typo (`?stat=running`) must not pass silently."""
    route = request.scope.get("route")
    if route is None:
        return
    known = {param.alias for param in get_flat_dependant(route.dependant).query_params}
    unknown = [(name, value) for name, value in request.query_params.multi_items() if name not in known]
    if unknown:
        raise RequestValidationError(
            [
                {"type": "extra_forbidden", "loc": ("query", name), "msg": "Unknown query parameter", "input": value}
                for name, value in unknown
            ]
        )
