"""What our two vLLM KV connectors share: the scheduler half delegates to a planner, the
worker half to a worker, and telemetry goes through vLLM's connector-stats path.

Subclasses name their planner, worker and metadata classes. The cluster token comes
from ASCENDSERVE_CLUSTER_TOKEN, never from the engine config (vLLM logs that).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                              KVConnectorTransferResults)

from ascendserve.config import environ
from ascendserve.connectors.kv.pull_plan import PullSettings
from ascendserve.connectors.kv.stats import KVTransferProm, KVTransferStats


def total_kv_heads(model_config) -> int:
    """KV heads over all TP ranks, as the caches hold them. An MLA model's cache is one latent
    per token with no head axis, the same on every rank (vLLM reports the attention heads,
    e.g. 4, which no rank's cache has): one head, replicated over TP."""
    return 1 if getattr(model_config, "use_mla", False) else model_config.get_total_num_kv_heads()


class AscendKVConnector(KVConnectorBase_V1):
    metadata_cls: type
    planner_cls: type
    worker_cls: type

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        settings = PullSettings.from_extra(cfg.kv_connector_extra_config or {})
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._planner = self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = self.planner_cls(settings, str(cfg.engine_id), tp_size,
                                             vllm_config.cache_config.block_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = self.worker_cls(settings, environ().get("ASCENDSERVE_CLUSTER_TOKEN", ""),
                                           get_tensor_model_parallel_rank(), cfg.is_kv_producer, tp_size=tp_size,
                                           total_kv_heads=total_kv_heads(vllm_config.model_config))

    def _meta(self):
        meta = self._get_connector_metadata()
        return meta if isinstance(meta, self.metadata_cls) else None

    # ---- scheduler side --------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._planner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._planner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._planner.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._planner.request_finished(request, block_ids)

    # ---- worker side -----------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        # the manager's block count: views of kernel blocks hold a multiple of it
        num_blocks = getattr(getattr(self, "_kv_cache_config", None), "num_blocks", None)
        self._worker.register_kv_caches(kv_caches, num_blocks=num_blocks if isinstance(num_blocks, int) else None)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if (meta := self._meta()) is not None:
            self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recvd, failed = self._worker.get_transfer_results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recvd, failed_recving=failed)

    # ---- telemetry -------------------------------------------------------
    def get_kv_connector_stats(self):
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return KVTransferStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVTransferProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for part in (self._worker, self._planner):
            if part is not None and hasattr(part, "shutdown"):
                part.shutdown()
