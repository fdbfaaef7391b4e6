"""Follow the registry: instances appear and disappear with no admin call.

Two sources of the same view (protocol.registry.InstanceView):
    MetaserverWatch  polls GET /v1/registry/instances of cluster.metaserver_url
    EtcdWatch        ranges over /ascendserve/<cluster>/instances/ once, then watches the prefix
                     (a change reaches every proxy at once), and lists metaservers the same way
Both hand each view to `RegistryWatch.apply`, which adds what joined and treats what left as
suspect, not dead: an instance that left the registry (a lapsed lease, a late heartbeat under CPU
oversubscription) but answers the proxy's requests or health checks keeps being routed to; one
that stays silent gets no new requests while its role has another, and is drained once silent for
`forget_after_s`. The engines' reported load (running + waiting requests) is kept beside the
proxy's own in-flight counts, so proxies sharing the instances see each other's traffic.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import msgspec
import structlog

from ascendserve.discovery import etcd as etcd_api
from ascendserve.protocol.registry import InstanceView, Load, Registration, RegistryView
from ascendserve.protocol.wire import decode_json
from ascendserve.router.health import HealthMonitor
from ascendserve.router.pools import ACTIVE, DRAINING, EJECTED, PROBING, SUSPECT, Pools
from ascendserve.web.upstream import Upstream, UpstreamError

log = structlog.get_logger("ascendserve.router.discovery")


class RegistryWatch:
    """What a registry view does to the pools; subclasses fetch the views."""

    kind = "registry"

    def __init__(self, pools: Pools, health: HealthMonitor, forget_after_s: float, clock=time.monotonic):
        self.pools, self.health = pools, health
        self.forget_after_s, self.clock = forget_after_s, clock
        self._live: set[tuple[str, str]] = set()
        self.reachable = True
        self.where = ""  # for readiness messages
        self.metaservers: list[str] = []  # push mode: the metaservers the registry knows
        self.on_event = lambda kind, inst, detail="": None  # joined, suspect, registered, draining, restarted

    async def run(self) -> None:
        raise NotImplementedError

    def apply(self, view: RegistryView) -> None:
        live = {(i.role, i.url.rstrip("/")): i for i in view.instances if i.role in self.pools.by_role}
        self._live = set(live)
        added = False
        for (role, url), info in live.items():
            known = self.pools[role].instances.get(url)
            # back while still draining its requests (it was silent too long, or was restarted):
            # routed to again; left draining, it would be forgotten and never re-added
            if known is None or (known.state == DRAINING and known.source == "registry"):
                known = self.pools[role].add(url, source="registry", instance_id=info.instance_id)
                log.info("instance joined through the registry", role=role, url=url, instance=info.instance_id)
                self.on_event("joined", known, info.instance_id)
                added = True
            if known.source != "registry":
                continue
            if info.instance_id and known.instance_id and info.instance_id != known.instance_id:
                self.on_event("restarted", known, f"instance id {known.instance_id} -> {info.instance_id}")
                known.instance_id = info.instance_id
            if info.kv is not None:
                known.kv = info.kv
            if info.cache is not None:
                known.cache = info.cache
            self.report_load(known, info.load)
            if known.missing_since is not None:
                known.missing_since = None
                if known.state == SUSPECT:
                    self.pools[role].set_state(known, ACTIVE)
                    log.info("instance registered again", role=role, url=url)
                    self.on_event("active", known, "registered again")
        self.review()
        if added:
            self.health.wake()

    def report_load(self, inst, load: Load) -> None:
        """The engine's own count of requests, from every proxy: what is not ours is others'."""
        inst.kv_usage = load.kv_usage
        others = max(0, load.running + load.waiting - inst.total_requests)
        if others != inst.others:
            inst.others = others
            self.pools[inst.role].touch(inst)

    def review(self) -> None:
        """Instances that left the registry: suspect until they answer, drained once long silent."""
        now = self.clock()
        wake = False
        for inst in self.pools.all_instances():
            if inst.source != "registry" or inst.state == DRAINING or (inst.role, inst.url) in self._live:
                continue
            if inst.missing_since is None:
                inst.missing_since = now
            if inst.last_ok > inst.missing_since and inst.state != EJECTED:
                if inst.state == SUSPECT:  # it answered since: slow, not dead
                    self.pools[inst.role].set_state(inst, ACTIVE)
                    log.info("instance answers though its registration lapsed; routed to again", role=inst.role,
                             url=inst.url)
                    self.on_event("active", inst, "answers though its registration lapsed")
                continue
            silent_s = now - max(inst.missing_since, inst.last_ok)
            if silent_s >= self.forget_after_s or inst.state == PROBING:
                self.pools[inst.role].drain(inst.url)
                log.info("instance left the registry and stays silent; draining", role=inst.role, url=inst.url)
                self.on_event("draining", inst, "left the registry and stays silent")
            elif inst.state == ACTIVE:
                self.pools[inst.role].set_state(inst, SUSPECT)
                log.warning("instance left the registry; no new requests until it answers", role=inst.role,
                            url=inst.url)
                self.on_event("suspect", inst, "left the registry")
                wake = True
        if wake:
            self.health.wake()


class MetaserverWatch(RegistryWatch):
    kind = "metaserver"

    def __init__(self, pools: Pools, upstream: Upstream, health: HealthMonitor, metaserver_url: str,
                 token: str, poll_s: float, timeout_s: float, forget_after_s: float = 12.0):
        super().__init__(pools, health, forget_after_s)
        self.upstream = upstream
        self.url = metaserver_url.rstrip("/") + "/v1/registry/instances"
        self.where = f"metaserver {metaserver_url}"
        self.metaservers = [metaserver_url.rstrip("/")]
        self.headers = {"authorization": f"Bearer {token}"} if token else {}
        self.poll_s, self.timeout_s = poll_s, timeout_s

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
            if self.reachable:
                log.warning("metaserver unreachable; keeping the current instances", error=str(exc)[:200])
            self.reachable = False
            return
        if not self.reachable:
            log.info("metaserver reachable again")
        self.reachable = True
        self.forget_after_s = max(self.forget_after_s, 2 * view.heartbeat_timeout_s)
        self.apply(view)


def view_of(kvs: dict[str, bytes], revision: int) -> RegistryView:
    """The instances under the etcd prefix as a registry view (bad entries skipped; fields this version
    does not know are ignored: a newer engine's entry during a rolling upgrade still counts)."""
    out = []
    for key, value in sorted(kvs.items()):
        try:
            entry = msgspec.json.decode(value)
            if not isinstance(entry, dict):
                raise msgspec.ValidationError("not an object")
            reg = msgspec.convert({k: v for k, v in entry.items() if k in Registration.__struct_fields__},
                                  Registration)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("unreadable registry entry in etcd; skipped", key=key)
            continue
        if reg.check() is not None:
            continue
        out.append(InstanceView(instance_id=reg.instance_id, role=reg.role, url=reg.url, model=reg.model,
                                version=reg.version, load=reg.load, age_s=0.0, seed=reg.seed,
                                seed_model=reg.seed_model, kv=reg.kv, cache=reg.cache))
    return RegistryView(revision=revision, heartbeat_timeout_s=0.0, instances=out)


class EtcdWatch(RegistryWatch):
    """The instances and metaservers under /ascendserve/<cluster>/: one range, then a watch from the
    revision after it; a broken stream (a member died) continues on the next endpoint from the last
    revision seen, a compacted one starts again from a fresh range. An idle stream is re-opened every
    `idle_s` so a member that vanished without closing the connection is noticed."""

    kind = "etcd"

    def __init__(self, pools: Pools, health: HealthMonitor, settings: etcd_api.EtcdSettings,
                 timeout_s: float = 3.0, idle_s: float = 20.0):
        super().__init__(pools, health, forget_after_s=2.0 * settings.lease_ttl_s)
        self.settings, self.timeout_s, self.idle_s = settings, timeout_s, idle_s
        self.where = f"etcd {', '.join(settings.endpoints)}"
        self.prefix = etcd_api.ROOT + f"/{settings.cluster}/"
        self.instances_prefix = etcd_api.cluster_prefix(settings.cluster, "instances")
        self.metaservers_prefix = etcd_api.cluster_prefix(settings.cluster, "metaservers")
        self.kvs: dict[str, bytes] = {}
        self.revision = 0
        self._endpoint = 0
        self._token = ""
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.settings.ssl_context() or True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s),
            read_bufsize=1 << 22)  # one watch message holds every event of a revision
        ticker = asyncio.ensure_future(self._tick())
        try:
            while True:
                try:
                    if not self.revision:
                        await self._list()
                    await self._watch()
                except (etcd_api.EtcdError, aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                    if self.reachable:
                        log.warning("etcd unreachable; keeping the current instances", error=str(exc)[:300])
                    self.reachable = False
                    self._endpoint += 1
                    await asyncio.sleep(0.2 if self._endpoint % len(self.settings.endpoints) else 1.0)
        finally:
            ticker.cancel()
            await self._session.close()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.review()

    @property
    def endpoint(self) -> str:
        return self.settings.endpoints[self._endpoint % len(self.settings.endpoints)]

    async def _post(self, path: str, body: dict, timeout_s: float | None) -> aiohttp.ClientResponse:
        for attempt in range(2):
            if self.settings.username and not self._token:
                async with self._session.post(self.endpoint + "/v3/auth/authenticate", json={
                        "name": self.settings.username, "password": self.settings.password},
                        timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                    answer = await r.json(content_type=None)
                    if r.status != 200:
                        raise etcd_api.EtcdError(f"authenticate: {r.status} {answer}", r.status)
                    self._token = answer.get("token", "")
            headers = {"authorization": self._token} if self._token else {}
            r = await self._session.post(self.endpoint + path, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.timeout_s,
                                                                       sock_read=None if timeout_s else self.idle_s))
            if r.status == 200:
                return r
            text = (await r.read()).decode(errors="replace")
            r.release()
            if attempt == 0 and self.settings.username and etcd_api.auth_expired(r.status, text):
                self._token = ""
                continue
            raise etcd_api.EtcdError(f"{path}: {r.status} {text[:200]}", r.status)
        raise AssertionError("unreachable")

    async def _list(self) -> None:
        r = await self._post("/v3/kv/range", etcd_api.range_body(self.prefix), self.timeout_s)
        async with r:
            self.revision, self.kvs = etcd_api.parse_range(await r.json(content_type=None))
        self._publish()

    async def _watch(self) -> None:
        r = await self._post("/v3/watch", etcd_api.watch_body(self.prefix, self.revision + 1), None)
        async with r:
            if not self.reachable:
                log.info("etcd reachable again", endpoint=self.endpoint)
            self.reachable = True
            try:
                while True:
                    line = await r.content.readline()
                    if not line:
                        raise etcd_api.EtcdError(f"watch stream from {self.endpoint} ended")
                    if not line.strip():
                        continue
                    events = etcd_api.parse_watch(json.loads(line))
                    if events.canceled or events.compact_revision:
                        log.warning("etcd watch canceled (compacted); listing again",
                                    compact_revision=events.compact_revision)
                        self.revision = 0
                        return
                    for key, value in events.changes:
                        if value is None:
                            self.kvs.pop(key, None)
                        else:
                            self.kvs[key] = value
                    self.revision = max(self.revision, events.revision)
                    if events.changes:
                        self._publish()
            except TimeoutError:
                return  # idle for idle_s: open it again (from the last revision: nothing is lost)

    def _publish(self) -> None:
        instances = {k: v for k, v in self.kvs.items() if k.startswith(self.instances_prefix)}
        self.metaservers = sorted(url for k, v in self.kvs.items() if k.startswith(self.metaservers_prefix)
                                  and (url := _url(v)))
        self.apply(view_of(instances, self.revision))


def _url(value: bytes) -> str:
    try:
        entry = json.loads(value)
    except ValueError:
        return ""
    url = entry.get("url", "") if isinstance(entry, dict) else ""
    return url.rstrip("/") if isinstance(url, str) and url.startswith(("http://", "https://")) else ""
