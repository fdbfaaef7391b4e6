"""`AscendPullConnector`: vLLM KV connector for pull-mode P -> D hand-off.

Selected by ascendserve config (`[kv] connector = "pull"`); vLLM loads it via
kv_connector_module_path = "ascendserve.connectors.kv.pull". Scheduler-side
calls go to `PullPlanner` (pull_plan.py), worker-side calls to `PullWorker`
(pull_worker.py). The cluster token comes from ASCENDSERVE_CLUSTER_TOKEN,
never from the engine config (vLLM logs that).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorRole,
                                                              KVConnectorTransferResults)

from ascendserve.config import environ
from ascendserve.connectors.kv.pull_plan import PullMetadata, PullPlanner, PullSettings
from ascendserve.connectors.kv.pull_worker import PullWorker
from ascendserve.connectors.kv.stats import KVTransferProm, KVTransferStats


class AscendPullConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        settings = PullSettings.from_extra(cfg.kv_connector_extra_config or {})
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._planner: PullPlanner | None = None
        self._worker: PullWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = PullPlanner(settings, str(cfg.engine_id), tp_size)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            token = environ().get("ASCENDSERVE_CLUSTER_TOKEN", "")
            self._worker = PullWorker(settings, token, get_tensor_model_parallel_rank(), cfg.is_kv_producer,
                                      tp_size=tp_size,
                                      total_kv_heads=vllm_config.model_config.get_total_num_kv_heads())

    # ---- scheduler side --------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._planner.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._planner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> PullMetadata:
        return self._planner.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._planner.request_finished(request, block_ids)

    # ---- worker side -----------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, PullMetadata):
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
        if self._worker is not None:
            self._worker.shutdown()
