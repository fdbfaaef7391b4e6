"""Follow the metaserver registry: instances appear and disappear with no admin call."""

from __future__ import annotations

import asyncio

import msgspec
import structlog

from ascendserve.protocol.registry import RegistryView
from ascendserve.protocol.wire import decode_json
from ascendserve.router.health import HealthMonitor
from ascendserve.router.pools import Pools
from ascendserve.web.upstream import Upstream, UpstreamError

log = structlog.get_logger("ascendserve.router.discovery")


class RegistryWatch:
    def __init__(self, pools: Pools, upstream: Upstream, health: HealthMonitor, metaserver_url: str,
                 token: str, poll_s: float, timeout_s: float):
        self.pools, self.upstream, self.health = pools, upstream, health
        self.url = metaserver_url.rstrip("/") + "/v1/registry/instances"
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.revision = -1
        self._reachable = True

    async def run(self) -> None:
        while True:
            await self.sync_once()
            await asyncio.sleep(self.poll_s)

    async def sync_once(self) -> None:
        try:
            status, raw = await self.upstream.get(self.url, self.timeout_s, self.headers)
            if status != 200:
                raise UpstreamError(self.url, status, raw[:200].decode(errors="replace"))
            view = decode_json(raw, RegistryView)
        except (UpstreamError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            if self._reachable:
                log.warning("metaserver unreachable; keeping the current instances", error=str(exc)[:200])
            self._reachable = False
            return
        if not self._reachable:
            log.info("metaserver reachable again")
        self._reachable = True
        if view.revision == self.revision:
            return
        self.revision = view.revision
        self.apply(view)

    def apply(self, view: RegistryView) -> None:
        live = {(i.role, i.url.rstrip("/")): i for i in view.instances if i.role in self.pools.by_role}
        added = False
        for (role, url), info in live.items():
            known = self.pools[role].instances.get(url)
            # back while still draining its requests (it missed a heartbeat, or was restarted):
            # routed to again; left draining, it would be forgotten and never re-added
            if known is None or (known.state == "draining" and known.source == "registry"):
                inst = self.pools[role].add(url, source="registry", instance_id=info.instance_id)
                if info.kv is not None:
                    inst.kv = info.kv
                if info.cache is not None:
                    inst.cache = info.cache
                log.info("instance joined through the registry", role=role, url=url, instance=info.instance_id)
                added = True
        for inst in self.pools.all_instances():
            if inst.source == "registry" and (inst.role, inst.url) not in live and inst.state != "draining":
                self.pools[inst.role].drain(inst.url)
                log.info("instance left the registry; draining", role=inst.role, url=inst.url)
        if added:
            self.health.wake()
