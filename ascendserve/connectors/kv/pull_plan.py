"""Pull mode, scheduler side (EngineCore process) and the metadata it hands the workers.

Life cycle of a request:
    P  request_finished(max_tokens=1 done) -> keep blocks (delay free), return
       kv_transfer_params {remote_block_ids, remote_host/port, remote_request_id, ...};
       the worker holds them until D frees them or `ttl_s` passes.
    D  get_num_new_matched_tokens -> (prompt tokens not cached locally, load async)
       update_state_after_alloc   -> RecvPlan (local blocks <- tail of remote blocks);
                                     do_remote_prefill cleared: one transfer per request
       a D request aborted before its pull was planned -> P told to free at once.
Only `PullMetadata` crosses to the workers (vLLM's own scheduler -> worker IPC).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.request import RequestStatus

from ascendserve.config import environ
from ascendserve.connectors.kv.hold_announcer import HoldAnnouncer, local_host


@dataclass
class PullSettings:
    host: str  # address D uses to reach this P's side channel
    bind_host: str
    port: int  # base port; TP rank r listens on port + r
    ttl_s: float
    transport: str = "tcp"
    tls_ca: str = ""  # push: CA bundle for an https metaserver callback
    staging_mib: int = 256  # host staging buffers of device KV (kv/staging.py)

    @classmethod
    def from_extra(cls, extra: dict) -> "PullSettings":
        return cls(host=str(extra.get("host", "127.0.0.1")), bind_host=str(extra.get("bind_host", "127.0.0.1")),
                   port=int(extra["port"]), ttl_s=float(extra.get("ttl_s", 120.0)),
                   transport=str(extra.get("transport", "tcp")), tls_ca=str(extra.get("tls_ca", "")),
                   staging_mib=int(extra.get("staging_mib", 256)))


@dataclass
class RecvPlan:
    request_id: str
    local_blocks: list[int]
    remote_blocks: list[int]
    host: str
    port: int
    remote_request_id: str
    remote_tp: int = 1


@dataclass
class PullMetadata(KVConnectorMetadata):
    recv: list[RecvPlan] = field(default_factory=list)
    send: dict[str, tuple[list[int], float]] = field(default_factory=dict)  # P: request -> (blocks, ttl_s)
    free_remote: list[tuple[str, int, str]] = field(default_factory=list)  # D: (host, port, remote id)
    # No tokens scheduled this step: the engine only polls for transfers, so the
    # worker may wait a moment for one to finish instead of letting the engine spin.
    idle: bool = False


def _flat_blocks(remote) -> list[int]:
    if remote and isinstance(remote[0], (list, tuple)):  # per-KV-cache-group lists
        remote = remote[0]
    return [int(b) for b in remote or ()]


class PullPlanner:
    def __init__(self, settings: PullSettings, engine_id: str, tp_size: int, block_size: int = 0,
                 announce: bool = True):
        self.settings, self.engine_id, self.tp_size = settings, engine_id, tp_size
        self._recv: list[RecvPlan] = []
        self._send: dict[str, tuple[list[int], float]] = {}
        self._free: list[tuple[str, int, str]] = []
        # P: holds reach this host's workers at once, not only with the next step
        # (hold_announcer.py); started with the first hold, so D never runs one
        self._announce = announce and bool(settings.port)
        self.announcer: HoldAnnouncer | None = None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
            return 0, False
        n = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        local = blocks.get_unhashed_block_ids_all_groups()[0] if num_external_tokens > 0 else []
        remote = _flat_blocks(params.get("remote_block_ids"))
        self._recv.append(RecvPlan(request.request_id, list(local), remote[-len(local):] if local else [],
                                   str(params["remote_host"]), int(params["remote_port"]),
                                   str(params["remote_request_id"]), int(params.get("remote_ptp_size") or 1)))

    def build_connector_meta(self, scheduler_output) -> PullMetadata:
        meta = PullMetadata(self._recv, self._send, self._free,
                            idle=not getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        self._recv, self._send, self._free = [], {}, []
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            done = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            if not done or not block_ids:
                return False, None
            self._send[request.request_id] = (list(block_ids), self.settings.ttl_s)
            if self._announce:
                if self.announcer is None:
                    self.announcer = HoldAnnouncer(local_host(self.settings.bind_host), self.settings.port,
                                                   self.tp_size, environ().get("ASCENDSERVE_CLUSTER_TOKEN", ""))
                self.announcer.announce(request.request_id, block_ids, self.settings.ttl_s)
            return True, {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(block_ids),
                "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                "remote_host": self.settings.host, "remote_port": self.settings.port,
                "remote_ptp_size": self.tp_size, "remote_num_tokens": request.num_computed_tokens,
            }
        if params.get("do_remote_prefill") and params.get("remote_request_id"):
            # D gave up before pulling: let P free now rather than at its deadline.
            self._free.append((str(params["remote_host"]), int(params["remote_port"]),
                               str(params["remote_request_id"])))
        return False, None

    def shutdown(self) -> None:
        if self.announcer is not None:
            self.announcer.close()
