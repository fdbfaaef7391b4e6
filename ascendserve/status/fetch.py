"""Reading a cluster for `ascendserve status`: a proxy, a metaserver or etcd, over stdlib HTTP.

    proxy       GET /health (open: ready, or what is missing), GET /instances (cluster token: a
                row per instance), GET /metrics (open: request, error and retry totals)
    metaserver  GET /health (open: push pending), GET /v1/registry/instances (cluster token)
    etcd        the instances' registrations under /ascendserve/<cluster>/instances/
                (discovery/etcd.instances)

A source that cannot be reached gives a Snapshot with `error` set (the cluster is not ready as far
as anyone can tell); a refused credential raises AuthError, which no retry would fix.
"""

from __future__ import annotations

import json
import re
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass

from ascendserve.discovery import etcd
from ascendserve.status.snapshot import Row, Snapshot, registry_missing

TOKEN_ENV = "ASCENDSERVE_CLUSTER_TOKEN"


class AuthError(Exception):
    """The source refused our credentials (401/403): say which ones and where they came from."""


class Unreachable(Exception):
    """No answer, or not one we can read."""


@dataclass(frozen=True)
class Token:
    value: str
    source: str  # where it came from, for the messages: "$ASCENDSERVE_CLUSTER_TOKEN", "--token-file F"


class Client:
    """GETs JSON or text from one server, with the cluster token and the cluster's TLS trust."""

    def __init__(self, base: str, token: Token | None, context: ssl.SSLContext | None, timeout_s: float):
        self.base, self.token, self.context, self.timeout_s = base.rstrip("/"), token, context, timeout_s

    def get(self, path: str, auth: bool = False) -> tuple[int, bytes]:
        """(status, body) of GET base+path; 2xx and 503 (a health answer) are returned, others raise."""
        headers = {"accept": "application/json"}
        if auth and self.token is not None:
            headers["authorization"] = f"Bearer {self.token.value}"
        url = self.base + path
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s, context=self.context) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 503:
                return exc.code, exc.read()
            if exc.code in (401, 403):
                raise AuthError(self._refused(url, exc.code)) from None
            hint = " (is this the right URL, and the right kind of server?)" if exc.code in (404, 405) else ""
            raise Unreachable(f"{url} answered {exc.code} {exc.reason}{hint}") from None
        except urllib.error.URLError as exc:
            raise Unreachable(_why(url, exc.reason)) from None
        except (OSError, ValueError) as exc:  # a reset mid-body, a timeout while reading, a bad URL
            raise Unreachable(_why(url, exc)) from None

    def get_json(self, path: str, auth: bool = False) -> tuple[int, dict]:
        status, body = self.get(path, auth)
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            raise Unreachable(f"{self.base + path} did not answer JSON (is this the right URL?)") from None
        if not isinstance(answer, dict):
            raise Unreachable(f"{self.base + path} answered JSON that is not an object")
        return status, answer

    def _refused(self, url: str, status: int) -> str:
        if self.token is None:
            return (f"{url} answered {status}: it wants the cluster token and none was given; set "
                    f"{TOKEN_ENV} or pass --token-file FILE")
        return (f"{url} answered {status}: the cluster token from {self.token.source} was refused (not the "
                "token this cluster was started with)")


def _why(url: str, reason) -> str:
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"{url}: TLS certificate not trusted ({getattr(reason, 'verify_message', None) or reason}); pass --tls-ca with the "
                "cluster's CA bundle")
    if isinstance(reason, ConnectionRefusedError):
        return f"{url}: connection refused (nothing listens there)"
    if isinstance(reason, TimeoutError) or "timed out" in str(reason):
        return f"{url}: no answer (timed out)"
    text = getattr(reason, "strerror", None) or str(reason)
    return f"{url}: unreachable ({text})"


def from_proxy(client: Client) -> Snapshot:
    snap = Snapshot("proxy", client.base)
    try:
        status, health = client.get_json("/health")
        _, listed = client.get_json("/instances", auth=True)
    except Unreachable as exc:
        snap.error = str(exc)
        return snap
    snap.ready = status == 200  # 503 with what is missing otherwise
    snap.missing = [str(m) for m in health.get("missing", [])] if not snap.ready else []
    if not snap.ready and not snap.missing:
        snap.missing = [str(health.get("error", {}).get("message") or f"/health answered {status}")]
    for i in listed.get("instances", []):
        # the engine's own load (other proxies' requests, KV usage) reaches a proxy through the
        # registry only: for an instance it was given by flag or admin call, unknown rather than 0
        registered = i.get("source") == "registry"
        snap.rows.append(Row(
            role=i.get("role", ""), url=i.get("url", ""), instance_id=i.get("instance_id", ""),
            state=i.get("state", ""), in_flight=i.get("active_requests"),
            others=i.get("others") if registered else None, kv_usage=i.get("kv_usage") if registered else None,
            kv_held=i.get("active_kv") if i.get("role") == "prefill" else None,
            served=i.get("served"), failures=i.get("failures"), last_error=i.get("last_error", ""),
            model=",".join(i.get("models", []))))
    try:
        snap.totals = proxy_totals(client.get("/metrics")[1].decode(errors="replace"))
    except Unreachable:
        pass  # the table stands without them
    return snap


_SAMPLE = re.compile(r"^(ascendserve_proxy_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)
_STATUS = re.compile(r'status="(\d+)"')
TOTALS = {"ascendserve_proxy_retries": "retries", "ascendserve_proxy_migrations": "migrations",
          "ascendserve_proxy_encoder_fallbacks": "encoder_fallbacks",
          "ascendserve_proxy_client_disconnects": "client_disconnects"}


def proxy_totals(text: str) -> dict[str, float]:
    """Requests (and how many failed), retries, migrations, fallbacks, disconnects from the
    proxy's Prometheus text: counters summed over their labels."""
    out = dict.fromkeys(("requests", "failed", *TOTALS.values()), 0.0)
    for name, labels, value in _SAMPLE.findall(text):
        if value == "NaN":
            continue
        if name == "ascendserve_proxy_requests":
            out["requests"] += float(value)
            status = _STATUS.search(labels or "")
            if status and not status.group(1).startswith("2"):
                out["failed"] += float(value)
        elif name in TOTALS:
            out[TOTALS[name]] += float(value)
    return {k: int(v) if v.is_integer() else v for k, v in out.items()}


def from_metaserver(client: Client) -> Snapshot:
    snap = Snapshot("metaserver", client.base)
    try:
        _, health = client.get_json("/health")
        _, view = client.get_json("/v1/registry/instances", auth=True)
    except Unreachable as exc:
        snap.error = str(exc)
        return snap
    snap.push_pending = health.get("push_pending")
    snap.rows = [_registered(i, i.get("age_s")) for i in view.get("instances", [])]
    snap.missing = registry_missing(snap.rows)
    snap.ready = not snap.missing
    return snap


# etcd's answers to a missing, wrong or unprivileged user (its gateway maps them to 400, 401 or 403)
ETCD_AUTH_MESSAGES = ("authentication failed", "permission denied", "user name is empty", "invalid auth token",
                      "user name not found")


def from_etcd(settings: etcd.EtcdSettings, timeout_s: float) -> Snapshot:
    snap = Snapshot("etcd", " ".join(settings.endpoints) + f" (cluster {settings.cluster})")
    try:
        entries = etcd.instances(settings, timeout_s)
    except etcd.EtcdError as exc:
        if exc.status in (401, 403) or any(m in str(exc) for m in ETCD_AUTH_MESSAGES):
            raise AuthError(f"etcd refused us: {exc}; the user is --registry-username (or "
                            "ASCENDSERVE_REGISTRY_USERNAME), the password ASCENDSERVE_REGISTRY_PASSWORD") from None
        snap.error = str(exc)
        return snap
    except (OSError, ValueError, ssl.SSLError) as exc:
        snap.error = _why(settings.endpoints[0], exc)
        return snap
    snap.rows = [_registered(e, None) for e in entries]
    snap.missing = registry_missing(snap.rows)
    snap.ready = not snap.missing
    return snap


def _registered(entry: dict, age_s) -> Row:
    """A row from a registration (the metaserver's InstanceView, or the Registration in etcd)."""
    load = entry.get("load") or {}
    return Row(role=entry.get("role", ""), url=entry.get("url", ""), instance_id=entry.get("instance_id", ""),
               state="registered", kv_usage=load.get("kv_usage"), model=entry.get("model", ""),
               running=load.get("running"), waiting=load.get("waiting"), age_s=age_s)
