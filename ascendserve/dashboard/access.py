"""Who may see the dashboard: loopback clients; elsewhere whoever holds the cluster token.

    client on loopback (127.0.0.0/8, ::1)          -> open
    elsewhere, cluster.token set                   -> a session cookie from the login page, or
                                                      the token as a header (scripts, bench/load.py)
    elsewhere, no token, allow_unauthenticated     -> open
    elsewhere, no token                            -> refused (403, saying why)

A browser presents the token once, in the login form's POST body (never in a URL); the reply
sets an HttpOnly, SameSite=Strict cookie holding a random session id. Only a hash of each id is
kept, with its expiry, so the table never holds a usable credential and a lookup's timing says
nothing about the ids; the token itself is compared in constant time (web/auth.matches). The
cookie's name carries the port: a proxy and a metaserver on one host keep separate sessions.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import time
from collections.abc import Callable, MutableMapping

from litestar.connection import ASGIConnection

from ascendserve.web.auth import matches, presented_token

OPEN, ALLOWED, LOGIN, REFUSED = "open", "allowed", "login", "refused"
REFUSED_MESSAGE = ("the dashboard is open to loopback clients only when no cluster token is set: set cluster.token "
                   "(--cluster-token / ASCENDSERVE_CLUSTER_TOKEN) and log in with it, or set "
                   "cluster.allow_unauthenticated = true to show it to anyone who can reach this port")


def is_loopback_client(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or address).is_loopback


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()


class Access:
    def __init__(self, token: str, allow_unauthenticated: bool, port: int, secure: bool = False,
                 ttl_s: float = 12 * 3600.0, max_sessions: int = 256, clock: Callable[[], float] = time.monotonic,
                 sessions: MutableMapping[bytes, float] | None = None):
        """`sessions`: where the sessions live (a dict; the proxy workers' shared table, so that a
        login through one worker holds in all)."""
        self.token, self.allow_unauthenticated = token, allow_unauthenticated
        self.cookie = f"ascendserve_dashboard_{port}"
        self.secure, self.ttl_s, self.max_sessions, self.clock = secure, ttl_s, max_sessions, clock
        self._sessions = {} if sessions is None else sessions  # sha256(session id) -> expiry

    @property
    def login_enabled(self) -> bool:
        return bool(self.token)

    def decide(self, connection: ASGIConnection) -> str:
        client = connection.client.host if connection.client else ""
        if is_loopback_client(client):
            return OPEN
        if not self.token:
            return OPEN if self.allow_unauthenticated else REFUSED
        if self.valid(connection.cookies.get(self.cookie, "")):
            return ALLOWED
        presented = presented_token(connection.headers)
        if presented and matches(presented, [self.token]):
            return ALLOWED
        return LOGIN

    # ---- sessions -------------------------------------------------------------------------------
    def login(self, presented: str) -> str | None:
        """A new session id when `presented` is the cluster token, else None."""
        if not self.token or not matches(presented, [self.token]):
            return None
        now = self.clock()
        for key in [k for k, v in self._sessions.items() if v <= now]:
            self._sessions.pop(key, None)
        while len(self._sessions) >= self.max_sessions:  # the oldest go first
            self._sessions.pop(min(self._sessions, key=self._sessions.__getitem__))
        session_id = secrets.token_urlsafe(32)
        self._sessions[_digest(session_id)] = now + self.ttl_s
        return session_id

    def valid(self, session_id: str) -> bool:
        if not session_id:
            return False
        expiry = self._sessions.get(_digest(session_id))
        if expiry is None:
            return False
        if expiry <= self.clock():
            self._sessions.pop(_digest(session_id), None)
            return False
        return True

    def logout(self, session_id: str) -> None:
        if session_id:
            self._sessions.pop(_digest(session_id), None)

    def set_cookie(self, session_id: str) -> str:
        secure = "; Secure" if self.secure else ""
        return (f"{self.cookie}={session_id}; Path=/dashboard; Max-Age={int(self.ttl_s)}; HttpOnly; "
                f"SameSite=Strict{secure}")

    def clear_cookie(self) -> str:
        secure = "; Secure" if self.secure else ""
        return f"{self.cookie}=; Path=/dashboard; Max-Age=0; HttpOnly; SameSite=Strict{secure}"
