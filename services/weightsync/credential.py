"""The shared secret that guards UpdateWeights: whoever may push weights decides what the policy is.

The learner's pusher and every rollout server read the same token from `OMRL_WEIGHT_TOKEN` (the local
launcher makes one per run; the chart/compose take it from a secret). It travels as gRPC metadata
`authorization: Bearer <token>` and is compared in constant time. Not done: TLS/mTLS, so on an
untrusted network the token can be read off the wire.

Rule for a server without a token: it starts only when bound to a loopback address, where only local
processes can reach it, and says at start-up that pushes are unauthenticated."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Iterable

from services.common.errors import Unauthenticated

log = logging.getLogger(__name__)

TOKEN_ENV = "OMRL_WEIGHT_TOKEN"
HEADER = "authorization"


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return ((HEADER, f"Bearer {token}"),) if token else ()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class PushAuthenticator:
    def __init__(self, token: str | None):
        self._expected = f"Bearer {token}".encode() if token else None

    @classmethod
    def for_server(cls, host: str, token: str | None) -> PushAuthenticator:
        """Refuses (SystemExit) a token-less server on a non-loopback address."""
        if not token:
            if not is_loopback(host):
                raise SystemExit(
                    f"{TOKEN_ENV} is not set and the server binds {host}: refusing to accept "
                    "unauthenticated weight pushes from the network (set the token, or bind 127.0.0.1)"
                )
            log.warning(
                "%s is not set: weight pushes are unauthenticated (accepted on loopback %s only)", TOKEN_ENV, host
            )
        return cls(token)

    def check(self, metadata: Iterable[tuple[str, object]], peer: str = "?") -> None:
        if self._expected is None:
            return
        given = next((v for k, v in metadata if k.lower() == HEADER), "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given, self._expected):
            log.warning("weight push from %s refused: %s", peer, "wrong token" if given else "no token")
            raise Unauthenticated("weight push refused: missing or wrong token (OMRL_WEIGHT_TOKEN)")
