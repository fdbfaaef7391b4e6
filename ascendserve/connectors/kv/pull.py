"""`AscendPullConnector`: vLLM KV connector for pull-mode P -> D hand-off.

Selected by ascendserve config (`[kv] connector = "pull"`); vLLM loads it via
kv_connector_module_path = "ascendserve.connectors.kv.pull". Scheduler-side
calls go to `PullPlanner` (pull_plan.py), worker-side calls to `PullWorker`
(pull_worker.py).
"""

from __future__ import annotations

from ascendserve.connectors.kv.connector import AscendKVConnector
from ascendserve.connectors.kv.pull_plan import PullMetadata, PullPlanner
from ascendserve.connectors.kv.pull_worker import PullWorker


class AscendPullConnector(AscendKVConnector):
    metadata_cls = PullMetadata
    planner_cls = PullPlanner
    worker_cls = PullWorker
