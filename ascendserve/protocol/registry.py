"""Registry messages between engine roles, the metaserver and the proxy (JSON over HTTP)."""

from __future__ import annotations

import msgspec

from ascendserve.protocol.kv_connectors import KVInfo
from ascendserve.protocol.kv_events import CacheInfo

ENGINE_ROLES = ("encoder", "prefill", "decode", "pd")
# Roles that may register: the engines, and NetLoader seeds without an engine.
REGISTERED_ROLES = (*ENGINE_ROLES, "elastic-server")


class Load(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # vLLM's KV cache usage, 0..1


class Registration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/registry/register: an engine instance announces itself."""

    instance_id: str
    role: str
    url: str
    model: str
    version: str = ""
    load: Load = msgspec.field(default_factory=Load)
    # NetLoader: host:port of the weights this instance serves, and the model's identity
    # (sha256 of its canonical config.json); empty when it serves none
    seed: str = ""
    seed_model: str = ""
    # P and D: their KV connector (protocol/kv_connectors.py); the proxy pairs only equal ones
    kv: KVInfo | None = None
    # pd and prefill: where its KV cache events are published and how it hashes blocks
    cache: CacheInfo | None = None

    def check(self) -> str | None:
        if self.role not in REGISTERED_ROLES:
            return f"role must be one of {', '.join(REGISTERED_ROLES)}, got {self.role!r}"
        if not self.url.startswith(("http://", "https://")):
            return f"url must be http(s)://host:port, got {self.url!r}"
        if not self.instance_id or len(self.instance_id) > 256:
            return "instance_id must be 1..256 characters"
        if self.cache is not None and (why := self.cache.check()):
            return why
        return self.kv.check() if self.kv is not None else None


class Heartbeat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/registry/heartbeat; 404 means "unknown, register again"."""

    instance_id: str
    load: Load = msgspec.field(default_factory=Load)


class Deregistration(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    instance_id: str


class InstanceView(msgspec.Struct, kw_only=True):
    instance_id: str
    role: str
    url: str
    model: str
    version: str
    load: Load
    age_s: float
    seed: str = ""
    seed_model: str = ""
    kv: KVInfo | None = None
    cache: CacheInfo | None = None


class RegistryView(msgspec.Struct, kw_only=True):
    """GET /v1/registry/instances: the live set; `revision` grows on every change."""

    revision: int
    heartbeat_timeout_s: float
    instances: list[InstanceView]
