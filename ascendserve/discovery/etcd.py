"""etcd v3 as the cluster registry, through etcd's own JSON gateway (`/v3/...` on the client port).

Why the gateway and not a client library: it is served by every etcd since 3.3 on the port clients
use anyway, speaks JSON over the HTTP clients we already have (urllib in the engines' heartbeat
thread, aiohttp in the proxy), takes our TLS contexts as they are, and needs no grpcio/protobuf,
whose pins collide with vLLM's. The maintained Python gRPC clients are either unmaintained
(python-etcd3, last release 2020) or pull grpcio in. What we use of the API is small: leases,
put, range over a prefix, delete, watch (a streamed response of JSON objects) and authenticate.

Keys, values JSON:
    /ascendserve/<cluster>/instances/<instance_id>    protocol.registry.Registration, on the instance's lease
    /ascendserve/<cluster>/metaservers/<instance_id>  {"url": ...}, on the metaserver's lease

A lease's TTL is `registry.lease_ttl_s`; its holder keeps it alive every heartbeat interval, so a
process that dies (SIGKILL included) disappears from every watcher one TTL later, and one that
exits cleanly revokes it at once. Requests go to one endpoint, the next one on a connection error
(a cluster member down), each once per call. With a username the client authenticates and
re-authenticates when etcd says its token expired.
"""

from __future__ import annotations

import base64
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from ascendserve.tls import client_context

ROOT = "/ascendserve"


class EtcdError(Exception):
    """etcd answered with an error, or no endpoint answered."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


def b64(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.b64encode(raw).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text or "")


def prefix_end(prefix: str) -> str:
    """etcd's range_end for every key starting with `prefix` (the prefix with its last byte + 1)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b64(b"\0")
    raw[-1] += 1
    return b64(bytes(raw))


def cluster_prefix(cluster: str, kind: str) -> str:
    """Where one cluster keeps one kind of entry: instances or metaservers."""
    return f"{ROOT}/{cluster}/{kind}/"


def range_body(prefix: str) -> dict:
    return {"key": b64(prefix), "range_end": prefix_end(prefix)}


def parse_range(answer: dict) -> tuple[int, dict[str, bytes]]:
    """A range answer: the store's revision and key -> value."""
    revision = int(answer.get("header", {}).get("revision", 0))
    return revision, {unb64(kv["key"]).decode(errors="replace"): unb64(kv.get("value", ""))
                      for kv in answer.get("kvs", [])}


def watch_body(prefix: str, start_revision: int) -> dict:
    return {"create_request": {**range_body(prefix), "start_revision": start_revision}}


@dataclass
class WatchEvents:
    """One message of a watch stream: puts (key -> value) and deletes in order, or the news that
    the watch ended (compacted: start again from a fresh range)."""

    revision: int = 0
    changes: list[tuple[str, bytes | None]] = field(default_factory=list)
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0


def parse_watch(message: dict) -> WatchEvents:
    if "error" in message:
        raise EtcdError(f"watch: {message['error'].get('message', message['error'])}",
                        int(message["error"].get("http_code", 0) or 0))
    result = message.get("result", message)
    out = WatchEvents(revision=int(result.get("header", {}).get("revision", 0)),
                      created=bool(result.get("created")), canceled=bool(result.get("canceled")),
                      compact_revision=int(result.get("compact_revision", 0) or 0))
    for event in result.get("events", []):
        kv = event.get("kv", {})
        key = unb64(kv.get("key", "")).decode(errors="replace")
        out.changes.append((key, None if event.get("type") == "DELETE" else unb64(kv.get("value", ""))))
    return out


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: tuple[str, ...]
    cluster: str = "default"
    lease_ttl_s: int = 10
    username: str = ""
    password: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_config(cls, config) -> "EtcdSettings":
        r = config.registry
        return cls(tuple(e.rstrip("/") for e in r.endpoints), r.cluster, r.lease_ttl_s, r.username,
                   r.password, config.cluster.tls_ca, r.tls_cert, r.tls_key)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not any(e.startswith("https://") for e in self.endpoints):
            return None
        ctx = client_context(self.tls_ca) or ssl.create_default_context()
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key or None)
        return ctx

    def to_dict(self) -> dict:
        """For a child process (the NetLoader's settings): everything but the password."""
        return {"endpoints": list(self.endpoints), "cluster": self.cluster, "lease_ttl_s": self.lease_ttl_s,
                "username": self.username, "tls_ca": self.tls_ca, "tls_cert": self.tls_cert,
                "tls_key": self.tls_key}

    @classmethod
    def from_dict(cls, fields: dict, password: str = "") -> "EtcdSettings":
        """What to_dict wrote (a child process's settings), with the password from the environment.
        ValueError on a malformed field."""
        if not isinstance(fields, dict):
            raise ValueError(f"etcd settings must be a map, got {type(fields).__name__}")
        endpoints = fields.get("endpoints", ())
        if isinstance(endpoints, str) or not all(isinstance(e, str) for e in endpoints):
            raise ValueError(f"etcd endpoints must be a list of URLs, got {str(endpoints)[:80]!r}")
        text = {k: fields.get(k, "") for k in ("username", "tls_ca", "tls_cert", "tls_key")}
        if not all(isinstance(v, str) for v in text.values()) or not isinstance(fields.get("cluster", ""), str):
            raise ValueError("etcd settings: cluster, username and the TLS paths must be strings")
        ttl = fields.get("lease_ttl_s", 10)
        if type(ttl) is not int:
            raise ValueError(f"etcd lease_ttl_s must be an integer, got {str(ttl)[:40]!r}")
        return cls(tuple(e.rstrip("/") for e in endpoints), fields.get("cluster") or "default", ttl,
                   text["username"], password, text["tls_ca"], text["tls_cert"], text["tls_key"])


def auth_expired(status: int, message: str) -> bool:
    return status == 401 or "auth token" in message or "invalid auth" in message


class Etcd:
    """A blocking client (stdlib only): the engines' heartbeat thread, the NetLoader, the metaserver's
    own announcement."""

    def __init__(self, settings: EtcdSettings, timeout_s: float = 3.0):
        if not settings.endpoints:
            raise EtcdError("no etcd endpoints configured (registry.endpoints)")
        self.settings, self.timeout_s = settings, timeout_s
        self._ctx = settings.ssl_context()
        self._current = 0
        self._token = ""

    def call(self, path: str, body: dict) -> dict:
        """POST one gateway call: the current endpoint, then the others on connection errors."""
        for attempt in range(2):
            try:
                return self._post_any(path, body)
            except EtcdError as exc:
                if attempt == 0 and self.settings.username and auth_expired(exc.status, str(exc)):
                    self._token = ""
                    continue
                raise
        raise AssertionError("unreachable")

    def _post_any(self, path: str, body: dict) -> dict:
        errors = []
        n = len(self.settings.endpoints)
        for i in range(n):
            index = (self._current + i) % n
            endpoint = self.settings.endpoints[index]
            try:
                if self.settings.username and not self._token and path != "/v3/auth/authenticate":
                    self._token = self._authenticate(endpoint)
                answer = self._post(endpoint, path, body)
                self._current = index
                return answer
            except (urllib.error.URLError, OSError) as exc:
                if isinstance(exc, urllib.error.HTTPError):
                    raise self._http_error(path, exc) from None
                errors.append(f"{endpoint}: {getattr(exc, 'reason', exc)}")
        raise EtcdError(f"no etcd endpoint answered {path}: {'; '.join(errors)}")

    def _authenticate(self, endpoint: str) -> str:
        answer = self._post(endpoint, "/v3/auth/authenticate",
                            {"name": self.settings.username, "password": self.settings.password})
        return answer.get("token", "")

    def _post(self, endpoint: str, path: str, body: dict) -> dict:
        headers = {"content-type": "application/json"}
        if self._token:
            headers["authorization"] = self._token
        req = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._ctx) as r:
            answer = json.loads(r.read() or b"{}")
        if isinstance(answer, dict) and "error" in answer and "result" not in answer:
            raise EtcdError(f"{path}: {answer.get('message') or answer['error']}", int(answer.get("code", 0)))
        return answer

    @staticmethod
    def _http_error(path: str, exc: urllib.error.HTTPError) -> EtcdError:
        try:
            detail = json.loads(exc.read() or b"{}")
            message = detail.get("message") or detail.get("error") or str(detail)
        except (ValueError, OSError):
            message = exc.reason
        return EtcdError(f"{path}: {exc.code} {message}", exc.code)

    # -- the calls we use
    def grant(self, ttl_s: int) -> int:
        return int(self.call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL after this keep-alive; 0: it expired (its keys are gone)."""
        answer = self.call("/v3/lease/keepalive", {"ID": lease})
        return int(answer.get("result", answer).get("TTL", 0) or 0)

    def revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": lease})

    def put(self, key: str, value: bytes, lease: int = 0) -> None:
        body = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = lease
        self.call("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": b64(key)})

    def range_prefix(self, prefix: str) -> tuple[int, dict[str, bytes]]:
        return parse_range(self.call("/v3/kv/range", range_body(prefix)))


class LeasedKey:
    """One key on a lease of its own, kept alive by `beat()`: put when first beaten or when its
    value changed, and again after the lease expired (etcd forgot it: a long stall, an etcd restart)."""

    def __init__(self, etcd: Etcd, key: str, ttl_s: int):
        self.etcd, self.key, self.ttl_s = etcd, key, ttl_s
        self.lease = 0
        self._value: bytes | None = None

    def beat(self, value: bytes) -> bool:
        """Keep the key alive with this value; True when it was (re)created."""
        if self.lease and self.etcd.keepalive(self.lease) > 0:
            if value != self._value:
                self.etcd.put(self.key, value, self.lease)
                self._value = value
            return False
        self.lease = self.etcd.grant(self.ttl_s)
        self.etcd.put(self.key, value, self.lease)
        self._value = value
        return True

    def revoke(self) -> None:
        if self.lease:
            lease, self.lease = self.lease, 0
            self.etcd.revoke(lease)


def instances(settings: EtcdSettings, timeout_s: float = 3.0) -> list[dict]:
    """The registered instances (their Registration bodies), for one-shot readers (NetLoader seeds)."""
    _, kvs = Etcd(settings, timeout_s).range_prefix(cluster_prefix(settings.cluster, "instances"))
    out = []
    for value in kvs.values():
        try:
            entry = json.loads(value)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out
