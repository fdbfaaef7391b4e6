"""Register this instance once it serves, keep the registration alive, leave on the way out.

Runs as a daemon thread beside vLLM's server in the engine role process
(stdlib HTTP only: nothing here may slow vLLM's event loop). The instance
registers only after its own /v1/models answers, so the proxy never routes
to an instance that is still loading. Where it registers is the registrar's
business: a metaserver (a 404 on heartbeat, the metaserver restarted or expired
us, means register again) or etcd (a key on a lease; an expired lease means put
it again). An unreachable registry is retried every interval without giving up.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import structlog

from ascendserve import __version__
from ascendserve.discovery import etcd
from ascendserve.tls import client_context

log = structlog.get_logger("ascendserve.discovery")
_GAUGE = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)
_KV_USAGE = re.compile(r"^vllm:kv_cache_usage_perc\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)


class MetaserverRegistrar:
    """Registration with a metaserver: POST register once, heartbeat after; 404: register again."""

    def __init__(self, metaserver_url: str, token: str, tls_ca: str = ""):
        self.base = metaserver_url.rstrip("/") + "/v1/registry"
        self.where = f"metaserver {metaserver_url}"
        self.tls = client_context(tls_ca)  # an https metaserver with a private CA
        self.headers = {"content-type": "application/json"}
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        self.registered = False

    def beat(self, body: dict) -> bool:
        """Keep `body` registered; True when this call (re)registered it."""
        if self.registered:
            try:
                beat = {"instance_id": body["instance_id"]}
                if "load" in body:  # none when the Heartbeat runs with_load=False: the metaserver's default
                    beat["load"] = body["load"]
                self._post("heartbeat", beat)
                return False
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise
                self.registered = False  # forgotten: register again right away
        self._post("register", body)
        self.registered = True
        return True

    def leave(self, instance_id: str) -> None:
        if self.registered:
            self._post("deregister", {"instance_id": instance_id})

    def _post(self, action: str, body: dict) -> None:
        req = urllib.request.Request(f"{self.base}/{action}", data=json.dumps(body).encode(),
                                     headers=self.headers, method="POST")
        with urllib.request.urlopen(req, timeout=5, context=self.tls) as r:
            r.read()


class EtcdRegistrar:
    """Registration in etcd: the body as a key on a lease that each beat keeps alive."""

    def __init__(self, settings: etcd.EtcdSettings, kind: str = "instances"):
        self.settings, self.kind = settings, kind
        self.where = f"etcd {', '.join(settings.endpoints)}"
        self.client = etcd.Etcd(settings)
        self.key: etcd.LeasedKey | None = None

    def beat(self, body: dict) -> bool:
        if self.key is None:
            self.key = etcd.LeasedKey(self.client, etcd.cluster_prefix(self.settings.cluster, self.kind)
                                      + body["instance_id"], self.settings.lease_ttl_s)
        return self.key.beat(json.dumps(body, sort_keys=True).encode())

    def leave(self, instance_id: str) -> None:
        if self.key is not None:
            self.key.revoke()


def registrar_for(config) -> MetaserverRegistrar | EtcdRegistrar | None:
    """Where this process registers: etcd, the metaserver, or nowhere."""
    if config.registry.backend == "etcd":
        return EtcdRegistrar(etcd.EtcdSettings.from_config(config))
    if config.cluster.metaserver_url:
        return MetaserverRegistrar(config.cluster.metaserver_url, config.cluster.token, config.cluster.tls_ca)
    return None


class Heartbeat:
    def __init__(self, registrar, instance_id: str, role: str, advertise_url: str, local_url: str, model: str,
                 interval_s: float, extra: dict | None = None, ready_path: str = "/v1/models",
                 ready_headers: dict | None = None, with_load: bool = True):
        self.registrar = registrar
        self.instance_id, self.role, self.url, self.model = instance_id, role, advertise_url, model
        self.local_url = local_url.rstrip("/")
        self.interval_s = interval_s
        self.extra = extra or {}  # more registration fields (a NetLoader seed's address)
        self.ready_path = ready_path
        self.ready_headers = ready_headers or {}
        self.with_load = with_load
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ascendserve-heartbeat", daemon=True)
        self.registered = False

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if self.registered:
            try:
                self.registrar.leave(self.instance_id)
            except (urllib.error.URLError, OSError, etcd.EtcdError):
                pass  # the deadline (a lease's TTL) removes us anyway

    def body(self) -> dict:
        body = {"instance_id": self.instance_id, "role": self.role, "url": self.url, "model": self.model,
                "version": __version__, **self.extra}
        if self.with_load:
            body["load"] = self._load()
        return body

    def _run(self) -> None:
        while not self._stop.is_set() and not self._local_ready():
            self._stop.wait(0.5)
        warned = False
        while not self._stop.is_set():
            try:
                if self.registrar.beat(self.body()):
                    log.info("registered", registry=self.registrar.where, url=self.url)
                self.registered = True
                warned = False
            except urllib.error.HTTPError as exc:
                log.warning("registry refused", registry=self.registrar.where, status=exc.code)
            except (urllib.error.URLError, OSError, etcd.EtcdError) as exc:
                if not warned:
                    log.warning("registry unreachable; will keep trying", registry=self.registrar.where,
                                error=str(exc)[:300])
                warned = True
            self._stop.wait(self.interval_s)

    def _local_ready(self) -> bool:
        try:
            req = urllib.request.Request(self.local_url + self.ready_path, headers=self.ready_headers)
            with urllib.request.urlopen(req, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _load(self) -> dict:
        """Requests running/waiting and the KV cache's usage (rounded: a put per real change), from
        vLLM's own /metrics."""
        load = {"running": 0, "waiting": 0}
        try:
            with urllib.request.urlopen(self.local_url + "/metrics", timeout=2) as r:
                text = r.read().decode(errors="replace")
            for kind, value in _GAUGE.findall(text):
                load[kind] += int(float(value))
            if usage := _KV_USAGE.findall(text):
                load["kv_usage"] = round(max(float(u) for u in usage), 2)
        except (urllib.error.URLError, OSError, ValueError):
            pass
        return load
