"""`AscendPushConnector`: vLLM KV connector for layerwise push from P to D.

Selected by ascendserve config (`[kv] connector = "push"`, proxy mode "push");
vLLM loads it via kv_connector_module_path = "ascendserve.connectors.kv.push".
Scheduler-side calls go to `PushPlanner` (push_plan.py), worker-side calls to
`PushWorker` (push_worker.py); P's worker sees every attention layer finish.
"""

from __future__ import annotations

from ascendserve.connectors.kv.connector import AscendKVConnector
from ascendserve.connectors.kv.push_plan import PushMetadata, PushPlanner
from ascendserve.connectors.kv.push_worker import PushWorker


class AscendPushConnector(AscendKVConnector):
    metadata_cls = PushMetadata
    planner_cls = PushPlanner
    worker_cls = PushWorker

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        if (meta := self._meta()) is not None:  # bound before the forward (loads start after it)
            self._worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        if (meta := self._meta()) is not None:
            self._worker.wait_for_save(meta)
