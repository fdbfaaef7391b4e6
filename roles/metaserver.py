"""Metaserver: the cluster registry and the push-mode prefill dispatcher.

With registry.backend = "etcd" the registry lives in etcd and the metaserver only dispatches push
mode: it announces itself under /ascendserve/<cluster>/metaservers/ (a key on its lease), where
proxies find every metaserver; a ticket names the one that issued it.
"""

from ascendserve.config import Config
from ascendserve.discovery import etcd
from ascendserve.discovery.heartbeat import EtcdRegistrar, Heartbeat
from ascendserve.metaserver.app import create_app
from ascendserve.web import server


def run(config: Config) -> int:
    announce = None
    if config.registry.backend == "etcd":
        announce = Heartbeat(EtcdRegistrar(etcd.EtcdSettings.from_config(config), kind="metaservers"),
                             config.instance_id, "metaserver", config.advertise_url, config.local_url, "",
                             config.metaserver.heartbeat_interval_s, ready_path="/health", with_load=False).start()
    try:
        return server.run(create_app(config), config.server)
    finally:
        if announce is not None:
            announce.stop()
