"""Instance admission and health: probe new instances, check active ones, eject, re-admit.

    probing  --GET /v1/models 200-->  active  (models recorded)
    active   --eject_after failures (periodic /health or failed request hops)-->  ejected
             (the last active one of its role: only by a failed /health check, run at once)
    ejected  --GET /health 200-->  active
    suspect  (left the registry) --GET /health 200-->  active: slow, not dead
    suspect  --eject_after failed /health checks-->  ejected: dead, not slow
An instance added through the admin API that never answers its probes is
dropped after `eject_after` tries, like vllm-ascend's waiting list.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog

from ascendserve.config import ProxyConfig
from ascendserve.protocol.kv_connectors import KVInfo
from ascendserve.protocol.kv_events import CacheInfo
from ascendserve.protocol.wire import decode_json
from ascendserve.router.pools import ACTIVE, DRAINING, EJECTED, PROBING, SUSPECT, Instance, Pools
from ascendserve.web.upstream import Upstream, UpstreamError

log = structlog.get_logger("ascendserve.router.health")


class HealthMonitor:
    def __init__(self, pools: Pools, upstream: Upstream, settings: ProxyConfig, on_state=None, after_checks=None):
        self.pools, self.upstream, self.settings = pools, upstream, settings
        self._wake = asyncio.Event()
        self.on_state = on_state or (lambda inst, state, before: None)  # an instance changed state
        self.after_checks = after_checks or (lambda: None)  # every round of checks is done

    def wake(self) -> None:
        """Probe now (an instance was just added)."""
        self._wake.set()

    def report_failure(self, inst: Instance) -> None:
        """A request hop could not reach `inst`.

        The last active instance of its role is not ejected on request errors alone: under a
        burst those are connect timeouts of a live instance, and ejecting it would fail every
        request of the role until the next check. Its health check runs at once instead and
        ejects it if it is really gone (failed requests count toward `eject_after` there)."""
        inst.failures += 1
        if inst.state != ACTIVE or inst.failures < self.settings.eject_after:
            return
        if any(other is not inst for other in self.pools[inst.role].active()):
            self._set(inst, EJECTED, "ejected after failed requests")
        else:
            log.warning("failed requests on the last active instance of its role; checking its health now",
                        url=inst.url, role=inst.role, failures=inst.failures)
            self._wake.set()

    def suspect(self, inst: Instance) -> None:
        """`inst` went silent mid-generation past the stall deadline (router/migrate.py): ejected at
        once unless it is the last of its role, and checked now (re-admitted when it answers)."""
        inst.failures = max(inst.failures, self.settings.eject_after - 1)
        self.report_failure(inst)
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self.check_all()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.health_interval_s)
            except TimeoutError:
                pass

    async def check_all(self) -> None:
        instances = [i for i in self.pools.all_instances() if i.state != DRAINING]
        await asyncio.gather(*(self._check(i) for i in instances))
        self.after_checks()

    async def _check(self, inst: Instance) -> None:
        if inst.state == PROBING:
            ok = await self._probe(inst)
        else:
            ok = await self._get_ok(inst, inst.url + "/health")
            if ok and inst.state == EJECTED:
                ok = await self._probe(inst)
        if ok:
            inst.failures = 0
            inst.last_error = ""
            inst.last_ok = time.monotonic()
            if inst.state in (PROBING, EJECTED):
                self._set(inst, ACTIVE, "admitted")
            elif inst.state == SUSPECT:
                self._set(inst, ACTIVE, "answers though its registration lapsed; routed to again")
            return
        inst.failures += 1
        if inst.state in (ACTIVE, SUSPECT) and inst.failures >= self.settings.eject_after:
            # a suspect one (it left the registry) that does not answer either is dead, not slow:
            # no longer a last resort, and /health says the role is missing
            self._set(inst, EJECTED, "ejected after failed health checks")
        elif inst.state == PROBING and inst.source == "admin" and inst.failures >= self.settings.eject_after:
            log.warning("instance never answered; not added", url=inst.url, role=inst.role)
            self.pools[inst.role].forget(inst.url)

    async def _probe(self, inst: Instance) -> bool:
        url = inst.url + "/v1/models"
        try:
            status, raw = await self.upstream.get(url, self.settings.health_timeout_s)
            if status != 200:
                inst.last_error = f"GET {url}: {status} {raw[:200].decode(errors='replace')}".strip()
                return False
            models = decode_json(raw).get("data", [])
            cards = tuple(m for m in models if isinstance(m, dict) and isinstance(m.get("id"), str))
            inst.cards = cards
            inst.models = tuple(m["id"] for m in cards)
            roots = [m.get("root") for m in models if isinstance(m, dict) and isinstance(m.get("root"), str)]
            inst.root = roots[0] if roots else ""
            if inst.role in ("prefill", "decode"):
                await self._kv_info(inst)
            if inst.role in ("prefill", "pd"):
                await self._cache_info(inst)
            return True
        except UpstreamError as exc:
            inst.last_error = f"GET {url}: {exc.detail[:200] or exc.status}"
            return False
        except (msgspec.DecodeError, AttributeError, TypeError):
            inst.last_error = f"GET {url}: not a model list"
            return False

    async def _kv_info(self, inst: Instance) -> None:
        """Its KV connector, from ascendserve's engine route /kv_info; a plain vLLM has none
        (404), and the registry's word, or nothing, stands."""
        if (info := await self._info(inst, "/kv_info", KVInfo)) is not None:
            inst.kv = info

    async def _cache_info(self, inst: Instance) -> None:
        """Where it publishes its KV cache events (ascendserve's engine route /cache_info); a plain
        vLLM, or an instance without events, has none (404) and is routed to by load."""
        if (info := await self._info(inst, "/cache_info", CacheInfo)) is not None:
            inst.cache = info

    async def _info(self, inst: Instance, path: str, kind: type):
        """One of ascendserve's engine info routes, decoded and checked; None when absent or bad."""
        try:
            status, raw = await self.upstream.get(inst.url + path, self.settings.health_timeout_s)
        except UpstreamError:
            return None
        if status != 200:
            return None
        try:
            info = msgspec.json.decode(raw, type=kind)
        except msgspec.DecodeError as exc:
            inst.last_error = f"GET {inst.url}{path}: {exc}"
            return None
        return info if info.check() is None else None

    async def _get_ok(self, inst: Instance, url: str) -> bool:
        try:
            status, raw = await self.upstream.get(url, self.settings.health_timeout_s)
        except UpstreamError as exc:
            inst.last_error = f"GET {url}: {exc.detail[:200] or exc.status}"
            return False
        if status != 200:
            inst.last_error = f"GET {url}: {status} {raw[:200].decode(errors='replace')}".strip()
        return status == 200

    def _set(self, inst: Instance, state: str, why: str) -> None:
        before = inst.state
        self.pools[inst.role].set_state(inst, state)
        self.on_state(inst, inst.state, before)
        log.info(why, url=inst.url, role=inst.role, state=state, models=list(inst.models))
