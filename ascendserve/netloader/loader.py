"""vLLM model loader `netloader`: weights from a running peer instead of storage.

Selected with `--load-format netloader` (ascendserve sets it from `[netloader]
sources`); its settings travel in `--model-loader-extra-config` under the key
"netloader"; the cluster token comes from the environment, never argv, so
vLLM's config log does not show it. Runs in every vLLM worker (each TP/PP
rank fetches on its own; rank r tries source r mod n first, so ranks spread
over seeds).

It is vLLM's own DefaultModelLoader with another weight iterator: each
tensor, once received and its CRC32C verified, goes through the model's
`load_weights` (its sharding and fusing for this rank) while the next ones
stream, then vLLM's check that every parameter was loaded. If a seed fails
before any data, the next seed is tried; if it fails mid-transfer, the next
seed or the disk loads every parameter again; if the model rejects what
arrived, the weights are loaded from disk as usual (fallback = "disk",
logged with the reason) or start-up stops with the reason (fallback =
"fail"). Never half a model.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request

import psutil
import structlog
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from ascendserve.netloader.base import WeightTransport
from ascendserve.tls import client_context
from ascendserve.netloader.checkpoint import identity
from ascendserve.netloader.client import STREAMS, NetLoadError, open_transfer

log = structlog.get_logger("ascendserve.netloader")
LOAD_FORMAT = "netloader"
TOKEN_ENV = "ASCENDSERVE_CLUSTER_TOKEN"  # vllm_server exports it; argv would show it
EXTRA_KEY = "netloader"
TRANSPORTS: dict[str, WeightTransport] = {"tcp": open_transfer}  # base.py: where HCCL / Mooncake ones would go


def _rank_info() -> dict:
    from vllm.distributed import parallel_state as ps

    info = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}
    try:
        tp, pp = ps.get_tp_group(), ps.get_pp_group()
        info.update(tp_rank=tp.rank_in_group, tp_size=tp.world_size, pp_rank=pp.rank_in_group,
                    pp_size=pp.world_size)
    except (AssertionError, AttributeError):  # not initialised: a single process
        pass
    return info


def registry_seeds(metaserver_url: str, token: str, config_sha256: str, timeout_s: float,
                   tls_ca: str = "") -> list[str]:
    """Seeds of this model the metaserver knows: dedicated elastic-servers first."""
    req = urllib.request.Request(metaserver_url.rstrip("/") + "/v1/registry/instances",
                                 headers={"authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=timeout_s, context=client_context(tls_ca)) as r:
        view = json.loads(r.read())
    return seeds_of(view.get("instances", []), config_sha256)


def etcd_seeds(settings, config_sha256: str, timeout_s: float) -> list[str]:
    """Seeds of this model registered in etcd (`settings`: an EtcdSettings): dedicated elastic-servers first."""
    from ascendserve.discovery import etcd

    return seeds_of(etcd.instances(settings, timeout_s), config_sha256)


def seeds_of(instances: list, config_sha256: str) -> list[str]:
    found = [i for i in instances if isinstance(i, dict) and i.get("seed") and i.get("seed_model") == config_sha256]
    found.sort(key=lambda i: (i.get("role") != "elastic-server", i.get("load", {}).get("running", 0)))
    return [i["seed"] for i in found]


class NetLoader(DefaultModelLoader):
    def __init__(self, load_config):
        extra = dict(load_config.model_loader_extra_config or {})
        self.settings = extra.pop(EXTRA_KEY, {}) or {}
        super().__init__(dataclasses.replace(load_config, load_format="auto", model_loader_extra_config=extra))
        self._received = None

    def download_model(self, model_config) -> None:
        """Nothing to download: the weights come from a seed (or the disk fallback's own files)."""

    def get_all_weights(self, model_config, model):
        if self._received is None:
            yield from super().get_all_weights(model_config, model)
            return
        self.counter_before_loading_weights = time.perf_counter()
        yield from self._received

    def load_weights(self, model, model_config) -> None:
        fallback = self.settings.get("fallback", "disk")
        why = self._load_from_seeds(model, model_config)
        if why is None:
            return
        if fallback != "disk":
            raise RuntimeError(f"netloader: no seed could provide the weights ({why}); "
                               "the disk fallback is off (netloader.fallback = 'fail')")
        log.warning("netloader: loading the weights from disk instead", reason=why)
        super().load_weights(model, model_config)

    def _load_from_seeds(self, model, model_config, in_place: bool = True) -> str | None:
        """None once one seed's weights are loaded, else why none were.

        A seed is used only once its handshake passed (right model, version, token, room); its
        verified tensors go into the model's `load_weights` while the rest stream. A seed failing
        mid-transfer leaves some parameters with its bytes: the next seed, or the disk, loads
        every parameter again (vLLM's load_weights writes them all), so no half model serves.

        In place: a checkpoint tensor whose parameter has its very name, dtype and shape (so,
        unquantized and unsharded) is received straight into the parameter, and load_weights'
        copy of it onto itself is a no-op (torch skips a copy between views of the same data).
        Only load_weights knows where a tensor really goes: if afterwards a parameter received
        in place no longer holds the tensor's bytes (the model transformed it while loading),
        everything is loaded again without in-place receiving."""
        try:
            ordered, open_transfer = self._seeds(model_config.model)
        except NetLoadError as exc:
            return str(exc)
        targets = {} if not in_place or getattr(model_config, "quantization", None) else \
            {name: p.data for name, p in model.named_parameters()}
        # load_weights copies a tensor into its parameter and lets go of it: its host buffer can take a later
        # tensor of its size. Not when a parameter is on a device: an asynchronous copy may still read it.
        recycle = all(p.device.type == "cpu" for p in model.parameters())
        errors = []
        for address in ordered:
            try:
                transfer = open_transfer(address, targets, recycle)
            except NetLoadError as exc:
                log.warning("netloader: seed failed", seed=address, error=str(exc))
                errors.append(str(exc))
                continue
            self._received = transfer
            again = ""  # why to load again without receiving in place
            try:
                super().load_weights(model, model_config)
                changed = transfer.changed_in_place()
                if not changed:
                    if transfer.in_place:
                        log.info("netloader: tensors received straight into their parameters",
                                 tensors=len(transfer.in_place), of=len(transfer.manifest))
                    return None
                again = f"the model's load_weights changed {len(changed)} of them ({', '.join(changed[:3])})"
            except Exception as exc:
                if transfer.error is None and not isinstance(exc, NetLoadError):
                    if not transfer.in_place:  # what arrived does not fit this model: all again from disk
                        return f"the model rejected the received weights: {type(exc).__name__}: {exc}"
                    # perhaps because of the in-place receiving (torch refuses a copy between aliases)
                    again = f"the model's load_weights failed: {type(exc).__name__}: {exc}"
                else:
                    why = transfer.error or str(exc)
                    log.warning("netloader: seed failed mid-transfer; the next source loads every weight again",
                                seed=address, error=why)
                    errors.append(why)
            finally:
                self._received = None
                transfer.close()
            if again:
                log.warning("netloader: loading again without receiving into the parameters", reason=again)
                return self._load_from_seeds(model, model_config, in_place=False)
        return "; ".join(errors) or "no sources"

    def _seeds(self, model_dir: str):
        """(seed addresses in this rank's order, address -> a joined transfer or NetLoadError)."""
        from ascendserve.config import environ

        token = environ().get(TOKEN_ENV, "")
        own = identity(model_dir)
        sources = self._sources(own["config_sha256"], token)
        rank = _rank_info()
        start = rank["tp_rank"] + rank["pp_rank"] * rank["tp_size"]
        ordered = sources[start % len(sources):] + sources[:start % len(sources)]
        # the whole checkpoint is held in host memory while it loads: keep headroom for the rest
        max_bytes = int(psutil.virtual_memory().available * 0.8)
        transport = TRANSPORTS.get(self.settings.get("transport", "tcp"))
        if transport is None:
            raise NetLoadError(f"unknown netloader transport {self.settings.get('transport')!r}; have "
                               f"{', '.join(TRANSPORTS)}")
        # the ranks of one instance share its host's link: its streams are split between them
        streams = max(1, int(self.settings.get("streams", STREAMS)) // (rank["tp_size"] * rank["pp_size"]))
        timeout_s = float(self.settings.get("timeout_s", 30.0))
        return ordered, lambda address, targets, recycle: transport(address, token, own, rank, timeout_s, max_bytes,
                                                                    streams=streams, targets=targets, recycle=recycle)

    def _sources(self, config_sha256: str, token: str) -> list[str]:
        sources = list(self.settings.get("sources") or [])
        timeout_s = float(self.settings.get("timeout_s", 30.0))
        if sources == ["auto"] and self.settings.get("etcd"):
            from ascendserve.config import environ
            from ascendserve.discovery.etcd import EtcdError, EtcdSettings

            try:  # vllm_server wrote them with EtcdSettings.to_dict; the password is in the environment
                etcd = EtcdSettings.from_dict(self.settings["etcd"], environ().get("ASCENDSERVE_REGISTRY_PASSWORD", ""))
            except ValueError as exc:
                raise NetLoadError(f"netloader's etcd settings: {exc}") from None
            try:
                sources = etcd_seeds(etcd, config_sha256, timeout_s)
            except (EtcdError, OSError, ValueError) as exc:
                raise NetLoadError(f"etcd unreachable for seed discovery: {exc}") from None
            if not sources:
                raise NetLoadError(f"etcd knows no seed of this model (config {config_sha256[:12]})")
        elif sources == ["auto"]:
            url = self.settings.get("metaserver_url", "")
            if not url:
                raise NetLoadError("netloader sources = ['auto'] needs a metaserver (cluster.metaserver_url)")
            try:
                sources = registry_seeds(url, token, config_sha256, timeout_s, self.settings.get("tls_ca", ""))
            except (OSError, ValueError) as exc:
                raise NetLoadError(f"metaserver {url} unreachable for seed discovery: {exc}") from None
            if not sources:
                raise NetLoadError(f"the metaserver knows no seed of this model (config {config_sha256[:12]})")
        return sources

def register() -> None:
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(NetLoader)
