"""Bearer-token checks, compared in constant time; tokens never reach a log or a reply.

A refused request gets 401 with a fixed message and one warning line naming
the route and the peer, never what was presented.
"""

from __future__ import annotations

import hmac

import structlog
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from ascendserve.protocol.openai import APIError

log = structlog.get_logger("ascendserve.auth")


def presented_token(headers) -> str:
    """The bearer token (or x-cluster-token) in `headers`: Litestar's Headers or a plain dict."""
    header = headers.get("authorization", "")
    if header[:7].lower() == "bearer ":
        return header[7:].strip()
    return headers.get("x-cluster-token", "")


def matches(presented: str, accepted: list[str]) -> bool:
    ok = False
    for token in accepted:  # no early exit: timing does not reveal which key matched
        ok |= hmac.compare_digest(presented.encode(), token.encode())
    return ok


def bearer_guard(accepted: list[str], what: str):
    """A Litestar guard accepting any of `accepted`; open when the list is empty
    (config refuses that off loopback for internal routes, see security.check)."""
    accepted = [t for t in accepted if t]

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        # async: Litestar runs a sync guard in a thread pool, a thread hop per request (a tenth of the
        # proxy's CPU, measured with py-spy)
        presented = presented_token(connection.headers)
        if accepted and not matches(presented, accepted):
            client = connection.client.host if connection.client else ""
            raise refused(connection.url.path, client, bool(presented), what)

    return guard


def refused(path: str, client, presented: bool, what: str) -> APIError:
    """The warning line of a refusal, and the 401 to answer. `client`: a host, or an ASGI scope's
    (host, port)."""
    host = client[0] if isinstance(client, (tuple, list)) and client else (client or "")
    log.warning("authentication failed", credential=what, path=path, client=host, presented=presented)
    return APIError(401, f"missing or invalid {what}", type="authentication_error", code="401")
