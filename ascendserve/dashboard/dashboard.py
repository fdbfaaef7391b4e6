"""One process's dashboard: its source of figures, its event feed, the hub that pushes both to the
pages, who may see it, and its routes. Built by the proxy's and the metaserver's `create_app`;
`run()` is a task of the app's lifespan."""

from __future__ import annotations

from litestar import Router

from ascendserve.config import Config
from ascendserve.dashboard.access import Access
from ascendserve.dashboard.events import EventFeed
from ascendserve.dashboard.hub import Hub, Source
from ascendserve.dashboard.routes import dashboard_router


class Dashboard:
    def __init__(self, source: Source, feed: EventFeed, access: Access, interval_s: float = 1.0):
        self.source, self.feed, self.access = source, feed, access
        self.hub = Hub(source, feed, interval_s)
        self.router: Router = dashboard_router(self.hub, access)

    @staticmethod
    def access_for(config: Config, sessions=None) -> Access:
        return Access(config.cluster.token, config.cluster.allow_unauthenticated, config.server.port,
                      secure=bool(config.server.tls_cert), sessions=sessions)

    @classmethod
    def for_proxy(cls, config: Config, pools, metrics, upstream, sessions=None) -> "Dashboard":
        """`sessions`: the logins' table shared by every proxy worker (router/workers.py)."""
        from ascendserve.dashboard.proxy_view import ProxySource

        source = ProxySource(f"proxy {config.server.host}:{config.server.port}", pools, metrics, upstream,
                             config.proxy.mode, config.proxy.encoder_fallback == "fail")
        return cls(source, EventFeed(), cls.access_for(config, sessions))

    @classmethod
    def for_metaserver(cls, config: Config, registry, upstream, push_asks=None) -> "Dashboard":
        from ascendserve.dashboard.registry_view import RegistrySource
        from ascendserve.discovery.etcd import EtcdSettings

        feed = EventFeed()
        settings = EtcdSettings.from_config(config) if config.registry.backend == "etcd" else None
        source = RegistrySource(f"metaserver {config.server.host}:{config.server.port}", registry, feed, upstream,
                                config.metaserver.heartbeat_interval_s, push_asks, settings)
        return cls(source, feed, cls.access_for(config))

    async def run(self) -> None:
        try:
            await self.hub.run()
        finally:
            await self.hub.close()
