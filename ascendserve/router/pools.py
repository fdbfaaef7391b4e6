"""Instances per role, chosen by load.

Each role's `Pool` keeps a min-heap of (priority, seq, url, version) entries
with lazy deletion: every change of an instance's counters bumps its
version and pushes a fresh entry; stale entries are dropped when they reach
the top. Counters are held by a `Lease` that releases exactly once, whatever
path the request takes (success, error, client cancellation).

Instance states: probing (added, not yet answering) -> active <-> ejected
(health) ; active -> suspect (it left the registry: a lease expired, a heartbeat
was late) -> active again when it answers a request or a health check, or ->
draining once it stayed silent; any -> draining (removed or tainted: no new
requests, dropped once its own in-flight requests finish). A suspect instance is
chosen only while its role has no active one: slow is not dead.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from ascendserve.protocol.kv_connectors import KVInfo
from ascendserve.protocol.kv_events import CacheInfo

PROBING, ACTIVE, EJECTED, DRAINING, SUSPECT = "probing", "active", "ejected", "draining", "suspect"
ROLES = ("encoder", "prefill", "decode", "pd")
KV_WEIGHT = 0.3  # prefill priority = active tokens + 0.3 x KV blocks held for D
DEFAULT_REQUEST_TOKENS = 256.0  # what a request of another proxy weighs before this one has seen any


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    source: str = "static"  # static | admin | registry
    instance_id: str = ""
    state: str = PROBING
    models: tuple[str, ...] = ()
    root: str = ""  # the model path it serves (vLLM's /v1/models `root`): part of every mm_hash
    cards: tuple[dict, ...] = ()  # its /v1/models entries as it sent them (the proxy relays them)
    last_error: str = ""  # why its last probe or health check failed ("" once it answered)
    kv: KVInfo | None = None  # P and D: its KV connector (its /kv_info, or the registry); None: it did not say
    cache: CacheInfo | None = None  # pd and P: its KV events and block hashing (its /cache_info, or the registry)
    active_requests: int = 0
    active_tokens: int = 0
    active_kv: int = 0
    others: int = 0  # requests the engine reports beyond this proxy's own (other proxies' traffic)
    kv_usage: float = 0.0  # the KV cache usage it reports (0..1; the registry)
    request_tokens: float = DEFAULT_REQUEST_TOKENS  # mean tokens of this proxy's requests to it
    failures: int = 0
    version: int = 0
    served: int = 0
    last_ok: float = field(default_factory=time.monotonic)  # its last answer: a request or a health check
    missing_since: float | None = None  # source registry: when it left the registry (None: registered)
    fingerprint: str | None = None  # its system_fingerprint, from the last stream that carried one
    # proxy workers (router/workers.py): its row in the shared counters (-1: none yet) and the table
    slot: int = -1
    peers: object = None  # workers.Counters, or None with one worker
    touched: int = 0  # when its counters or state last changed (its pool's sequence): ties go to the oldest

    def remember_fingerprint(self, value: str) -> None:
        """Its system_fingerprint, from a finished answer; every proxy worker learns it."""
        if value != self.fingerprint:
            self.fingerprint = value
            if self.peers is not None:
                self.peers.learned(self)

    def peer_load(self) -> tuple[int, int, int]:
        """The other workers' requests, tokens and KV blocks in flight on it."""
        if self.peers is None or self.slot < 0:
            return 0, 0, 0
        return self.peers.others(self.slot)

    @property
    def total_served(self) -> int:
        """Answers it gave this proxy: every worker's (each counts its own in the shared table)."""
        if self.peers is None or self.slot < 0:
            return self.served
        return self.served + self.peers.served(self.slot)

    @property
    def total_requests(self) -> int:
        """This proxy's requests in flight on it: every worker's."""
        return self.active_requests + self.peer_load()[0]

    @property
    def priority(self) -> float:
        _, tokens, kv = self.peer_load()
        tokens += self.active_tokens
        own = tokens + KV_WEIGHT * (self.active_kv + kv) if self.role == "prefill" else tokens
        return own + self.others * self.request_tokens

    def summary(self) -> dict:
        requests, tokens, kv = self.peer_load()
        return {"url": self.url, "role": self.role, "state": self.state, "source": self.source,
                "instance_id": self.instance_id, "models": list(self.models),
                "active_requests": self.active_requests + requests, "active_tokens": self.active_tokens + tokens,
                "active_kv": self.active_kv + kv, "others": self.others, "kv_usage": self.kv_usage,
                "failures": self.failures, "served": self.total_served,
                "last_error": self.last_error, "kv_connector": self.kv.connector if self.kv else ""}

    @property
    def kv_connector(self) -> str:
        return self.kv.connector if self.kv is not None else ""


class Lease:
    """Load taken on one instance for one request hop; `release()` is idempotent."""

    __slots__ = ("pool", "instance", "tokens", "kv", "_released")

    def __init__(self, pool: "Pool", instance: Instance, tokens: int, kv: int = 0):
        self.pool, self.instance, self.tokens, self.kv = pool, instance, tokens, kv
        self._released = False
        instance.active_requests += 1
        instance.active_tokens += tokens
        instance.request_tokens += (tokens - instance.request_tokens) / 16
        instance.active_kv += kv
        pool.touch(instance)

    @property
    def released(self) -> bool:
        return self._released

    def release(self, ok: bool = True) -> None:
        if self._released:
            return
        self._released = True
        inst = self.instance
        inst.active_requests -= 1
        inst.active_tokens -= self.tokens
        inst.active_kv -= self.kv
        if ok:
            inst.served += 1
            inst.last_ok = time.monotonic()
        self.pool.touch(inst)
        if inst.state == DRAINING and inst.active_requests == 0:
            self.pool.forget(inst.url)


class Pool:
    def __init__(self, role: str):
        self.role = role
        self.instances: dict[str, Instance] = {}
        self._heap: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self.peers = None  # workers.Counters: the other workers' load counts too (no heap: it changes under us)

    def __len__(self) -> int:
        return len(self.instances)

    def active(self) -> list[Instance]:
        """The active instances; while there are none, the suspect ones (a last resort)."""
        active = [i for i in self.instances.values() if i.state == ACTIVE]
        return active or [i for i in self.instances.values() if i.state == SUSPECT]

    def add(self, url: str, source: str = "static", instance_id: str = "") -> Instance:
        existing = self.instances.get(url)
        if existing is not None:
            if existing.state == DRAINING:  # re-added while draining: keep serving
                existing.state = PROBING
            existing.source, existing.instance_id = source, instance_id or existing.instance_id
            return existing
        inst = Instance(url=url, role=self.role, source=source, instance_id=instance_id, peers=self.peers)
        self.instances[url] = inst
        return inst

    def touch(self, inst: Instance) -> None:
        inst.version += 1
        inst.touched = next(self._seq)
        if self.peers is not None:
            self.peers.write(inst)
            return
        if inst.state == ACTIVE:
            heapq.heappush(self._heap, (inst.priority, next(self._seq), inst.url, inst.version))
        if len(self._heap) > 64 + 8 * len(self.instances):
            self._rebuild()

    def set_state(self, inst: Instance, state: str) -> None:
        if inst.state == DRAINING and state != DRAINING:
            return  # removal wins over health
        inst.state = state
        self.touch(inst)

    def _rebuild(self) -> None:
        self._heap = [(i.priority, next(self._seq), i.url, i.version) for i in self.active()]
        heapq.heapify(self._heap)

    def select(self, exclude: frozenset[str] = frozenset()) -> Instance | None:
        """The active instance with the lowest priority, skipping `exclude`."""
        if self.peers is not None:
            return self._scan(exclude)
        skipped = []
        chosen = None
        while self._heap:
            prio, seq, url, version = self._heap[0]
            inst = self.instances.get(url)
            if inst is None or inst.version != version or inst.state != ACTIVE:
                heapq.heappop(self._heap)
                continue
            if url in exclude:
                skipped.append(heapq.heappop(self._heap))
                continue
            chosen = inst
            break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if chosen is None and not any(i.state == ACTIVE for i in self.instances.values()):
            suspects = [i for i in self.instances.values() if i.state == SUSPECT and i.url not in exclude]
            chosen = min(suspects, key=lambda i: i.priority, default=None)
        return chosen

    def _scan(self, exclude: frozenset[str]) -> Instance | None:
        """select() with several workers: every priority read afresh (the others' counts move); of
        equal ones the least recently used, as the heap's order has it."""
        best = best_key = None
        for state in (ACTIVE, SUSPECT):
            for inst in self.instances.values():
                if inst.state == state and inst.url not in exclude:
                    key = (inst.priority, inst.touched)
                    if best is None or key < best_key:
                        best, best_key = inst, key
            if best is not None or any(i.state == ACTIVE for i in self.instances.values()):
                return best
        return None

    def lease(self, inst: Instance, tokens: int, kv: int = 0) -> Lease:
        return Lease(self, inst, tokens, kv)

    def drain(self, url: str) -> Instance | None:
        """Stop routing to `url`; it is forgotten once its requests finish."""
        inst = self.instances.get(url)
        if inst is None:
            return None
        inst.state = DRAINING
        self.touch(inst)
        if inst.active_requests == 0:
            self.forget(url)
        return inst

    def forget(self, url: str) -> None:
        self.instances.pop(url, None)


class Pools:
    """All role pools of one proxy."""

    def __init__(self):
        self.by_role = {role: Pool(role) for role in ROLES}

    def __getitem__(self, role: str) -> Pool:
        return self.by_role[role]

    def all_instances(self) -> list[Instance]:
        return [i for p in self.by_role.values() for i in p.instances.values()]

    def find(self, url: str) -> tuple[Pool, Instance] | None:
        for pool in self.by_role.values():
            if url in pool.instances:
                return pool, pool.instances[url]
        return None

    def has_active(self, role: str) -> bool:
        """Whether `role` can be routed to: an active instance, or a suspect one as a last resort."""
        return any(i.state in (ACTIVE, SUSPECT) for i in self.by_role[role].instances.values())

    def model_root(self, roles: tuple[str, ...]) -> str:
        """The model path served by the first active instance of these roles (in this order)."""
        for role in roles:
            for inst in self.by_role[role].instances.values():
                if inst.state == ACTIVE and inst.root:
                    return inst.root
        return ""

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for inst in self.all_instances():
            if inst.state in (ACTIVE, DRAINING):
                for m in inst.models:
                    seen.setdefault(m, None)
        return list(seen)

    def in_flight(self) -> int:
        return sum(i.total_requests for i in self.all_instances())

    def share(self, peers) -> None:
        """Several workers: count the others' load too (router/workers.py)."""
        for pool in self.by_role.values():
            pool.peers = peers

    def model_cards(self) -> list[dict]:
        """The engines' own /v1/models entries (one per model id, the serving roles' first), as vLLM
        lists them."""
        seen: dict[str, dict] = {}
        for role in ("decode", "pd", "prefill", "encoder"):
            for inst in self.by_role[role].instances.values():
                if inst.state in (ACTIVE, DRAINING):
                    for card in inst.cards:
                        seen.setdefault(card["id"], card)
        return list(seen.values())

    def readiness(self, encoders_required: bool = False) -> "Readiness":
        """Whether this topology can serve: at least one healthy instance of every role it needs.

        Needed: prefill and decode as soon as either is known (a P without a D, or the reverse,
        serves nothing), pd when pd instances are known, encoders only when they are known and
        the proxy may not fall back to local encoding (`encoders_required`). No engine known at
        all: not servable."""
        known = {r for r in ROLES if self.by_role[r].instances}
        needed = [r for r in ("prefill", "decode") if known & {"prefill", "decode"}]
        needed += ["pd"] if "pd" in known else []
        needed += ["encoder"] if encoders_required and "encoder" in known else []
        roles = {r: self.role_report(r) for r in ROLES if r in known or r in needed}
        missing = [f"no healthy {r} instance: {self.role_problem(r)}" for r in needed if not self.has_active(r)]
        # optional encoders: not needed, but not judged before their first check either (a test or a
        # client that waits for 200 expects the encoders it configured to be in use when they work)
        unchecked = [i for i in self.by_role["encoder"].instances.values() if i.state == PROBING and not i.failures]
        if "encoder" not in needed and unchecked and not self.has_active("encoder"):
            missing.append(f"encoder instances not checked yet: {len(unchecked)} probing")
        if not needed:
            missing.append("no engine instance registered yet (need a pd instance, or prefill and decode "
                           "instances)")
        return Readiness(not missing, roles, missing)

    def role_report(self, role: str) -> dict:
        insts = list(self.by_role[role].instances.values())
        report = {"healthy": sum(i.state == ACTIVE for i in insts), "total": len(insts)}
        for state in (PROBING, EJECTED, DRAINING, SUSPECT):
            if n := sum(i.state == state for i in insts):
                report[state] = n
        errors = [i.last_error for i in insts if i.last_error and i.state != ACTIVE]
        if errors:
            report["last_error"] = errors[-1]
        return report

    def role_problem(self, role: str) -> str:
        """Why `role` has no active instance, in words: counts by state and the last error seen."""
        insts = list(self.by_role[role].instances.values())
        words = {PROBING: "not answering yet", EJECTED: "ejected", DRAINING: "draining",
                 SUSPECT: "suspect (left the registry)"}
        parts = [f"{len(insts)} registered"]
        parts += [f"{n} {words[s]}" for s in (PROBING, EJECTED, DRAINING, SUSPECT)
                  if (n := sum(i.state == s for i in insts))]
        errors = [i.last_error for i in insts if i.last_error]
        return ", ".join(parts) + (f" (last error: {errors[-1][:300]})" if errors else "")


@dataclass
class Readiness:
    ok: bool
    roles: dict
    missing: list[str]

    @property
    def message(self) -> str:
        return "; ".join(self.missing)
