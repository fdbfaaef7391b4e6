"""Register this engine instance once it serves, heartbeat, deregister on the way out.

Runs as a daemon thread beside vLLM's server in the engine role process
(stdlib HTTP only: nothing here may slow vLLM's event loop). The instance
registers only after its own /v1/models answers, so the proxy never routes
to an instance that is still loading. A 404 on heartbeat (the metaserver
restarted or expired us) means register again; an unreachable metaserver
is retried every interval without giving up.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import structlog

from ascendserve import __version__
from ascendserve.tls import client_context

log = structlog.get_logger("ascendserve.discovery")
_GAUGE = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)


class Heartbeat:
    def __init__(self, metaserver_url: str, token: str, instance_id: str, role: str, advertise_url: str,
                 local_url: str, model: str, interval_s: float, extra: dict | None = None,
                 ready_path: str = "/v1/models", tls_ca: str = ""):
        self.base = metaserver_url.rstrip("/") + "/v1/registry"
        self.tls = client_context(tls_ca)  # an https metaserver with a private CA
        self.headers = {"content-type": "application/json"}
        if token:
            self.headers["authorization"] = f"Bearer {token}"
        self.instance_id, self.role, self.url, self.model = instance_id, role, advertise_url, model
        self.local_url = local_url.rstrip("/")
        self.interval_s = interval_s
        self.extra = extra or {}  # more registration fields (a NetLoader seed's address)
        self.ready_path = ready_path
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
                self._post("deregister", {"instance_id": self.instance_id})
            except (urllib.error.URLError, OSError):
                pass  # the deadline removes us anyway

    def _run(self) -> None:
        while not self._stop.is_set() and not self._local_ready():
            self._stop.wait(0.5)
        warned = False
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._post("register", {"instance_id": self.instance_id, "role": self.role, "url": self.url,
                                            "model": self.model, "version": __version__,
                                            "load": self._load(), **self.extra})
                    self.registered = True
                    log.info("registered with the metaserver", metaserver=self.base, url=self.url)
                else:
                    self._post("heartbeat", {"instance_id": self.instance_id, "load": self._load()})
                warned = False
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    self.registered = False  # forgotten: register again right away
                    continue
                log.warning("metaserver refused", status=exc.code, action="register" if not self.registered else "heartbeat")
            except (urllib.error.URLError, OSError) as exc:
                if not warned:
                    log.warning("metaserver unreachable; will keep trying", error=str(exc))
                warned = True
            self._stop.wait(self.interval_s)

    def _post(self, action: str, body: dict) -> None:
        req = urllib.request.Request(f"{self.base}/{action}", data=json.dumps(body).encode(),
                                     headers=self.headers, method="POST")
        with urllib.request.urlopen(req, timeout=5, context=self.tls) as r:
            r.read()

    def _local_ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.local_url + self.ready_path, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _load(self) -> dict:
        """Requests running/waiting, from vLLM's own /metrics."""
        load = {"running": 0, "waiting": 0}
        try:
            with urllib.request.urlopen(self.local_url + "/metrics", timeout=2) as r:
                text = r.read().decode(errors="replace")
            for kind, value in _GAUGE.findall(text):
                load[kind] += int(float(value))
        except (urllib.error.URLError, OSError, ValueError):
            pass
        return load
