"""Layerwise push mode, scheduler side (EngineCore process) and the metadata for the workers.

    proxy  -> D   kv_transfer_params {do_remote_prefill: true, metaserver: <callback URL>}
    D      get_num_new_matched_tokens -> (prompt tokens not cached here, load async)
           update_state_after_alloc   -> POST vllm-ascend's body to the callback (one event-loop thread):
                                         {request_id, token_ids, remote_block_ids: D's new
                                         blocks, remote_host/port: D's receiver, remote_cached_tokens}
           the worker waits for every layer (PUSHED) or its deadline; a failed POST fails it
    metaserver -> P   the same fields as kv_transfer_params, once per request
    P      every step that computes part of the prompt sends, per layer as soon as the
           layer is computed, the pages of the blocks touched so far; the step that
           finishes the prompt ends with PUSHED. P frees its blocks as usual.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import httpx
import structlog
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ascendserve.connectors.kv.pull_plan import PullSettings
from ascendserve.protocol.kv_params import base_request_id
from ascendserve.tls import client_context

log = structlog.get_logger("ascendserve.kv.push")


@dataclass
class PushPlan:
    """P: send these pages this step (D's blocks in the same order as P's)."""

    request_id: str  # D's engine request id
    local_blocks: list[int]
    remote_blocks: list[int]
    host: str
    port: int
    last: bool  # this step completes the prompt: send PUSHED after the layers
    abandon: bool = False  # cannot push (e.g. TP mismatch): tell D at once, it recomputes


@dataclass
class PushMetadata(KVConnectorMetadata):
    push: list[PushPlan] = field(default_factory=list)  # P
    expect: dict[str, list[int]] = field(default_factory=dict)  # D: request -> reserved blocks
    failed: list[str] = field(default_factory=list)  # D: the metaserver could not get P to prefill
    prefilled: list[str] = field(default_factory=list)  # D: P finished the prompt; its push is due now
    idle: bool = False


@dataclass
class _Outgoing:
    target: dict  # D's PushPrefillRequest fields
    blocks: list[int] = field(default_factory=list)  # P's blocks of the request so far
    skip: int = 0  # leading blocks D already had (its prefix cache)
    prompt_len: int = 0
    abandon: bool = False


class PushPlanner:
    def __init__(self, settings: PullSettings, engine_id: str, tp_size: int, block_size: int,
                 post_timeout_s: float | None = None):
        self.settings, self.engine_id, self.tp_size, self.block_size = settings, engine_id, tp_size, block_size
        self.post_timeout_s = post_timeout_s or settings.ttl_s
        self._out: dict[str, _Outgoing] = {}
        self._expect: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._failed: list[str] = []
        self._prefilled: list[str] = []
        self._finished_unpushed: list[_Outgoing] = []
        # One event loop thread carries every D -> metaserver ask: each waits until P has
        # prefilled, so a thread (or a pool slot) per ask would cap the prefills in flight.
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        threading.Thread(target=self._loop.run_forever, name="kv-push-ask", daemon=True).start()

    # ---- both ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill") or not params.get("metaserver"):
            return 0, False
        n = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode") and params.get("remote_block_ids") is not None:
            self._out[request.request_id] = self._outgoing(request.request_id, params, request)
            return
        if not (params.get("do_remote_prefill") and params.get("metaserver")):
            return
        params["do_remote_prefill"] = False  # one push per request
        local = list(blocks.get_unhashed_block_ids_all_groups()[0]) if num_external_tokens > 0 else []
        if not local:
            if num_external_tokens > 0:  # nothing to push into: fail the load now, not at a deadline
                log.warning("no blocks reserved for pushed KV; the request falls back by policy",
                            request=request.request_id)
                self._expect[request.request_id] = []
                with self._lock:
                    self._failed.append(request.request_id)
            return
        cached = len(request.prompt_token_ids or ()) - num_external_tokens
        self._expect[request.request_id] = local
        body = {"request_id": request.request_id, "token_ids": list(request.prompt_token_ids or ()),
                "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": local,
                "remote_block_size": self.block_size, "remote_engine_id": self.engine_id,
                "remote_host": self.settings.host, "remote_port": self.settings.port,
                "remote_tp_size": self.tp_size, "remote_cached_tokens": cached}
        asyncio.run_coroutine_threadsafe(self._ask_for_prefill(str(params["metaserver"]), body), self._loop)

    def _outgoing(self, request_id: str, params: dict, request) -> _Outgoing:
        batch = params.get("batch_kv_transfer_params")
        target = params
        if isinstance(batch, dict):  # a completion with several prompts: find mine
            mine = base_request_id(request_id)
            target = next((v for k, v in batch.items() if base_request_id(str(k)) == mine), params)
        cached = int(target.get("remote_cached_tokens") or 0)
        out = _Outgoing(target=target, skip=cached // self.block_size, prompt_len=len(request.prompt_token_ids or ()))
        d_tp = int(target.get("remote_tp_size") or self.tp_size)
        if d_tp != self.tp_size:
            log.warning("push mode needs the same TP on prefill and decode; decode will recompute",
                        request=request_id, prefill_tp=self.tp_size, decode_tp=d_tp)
            out.abandon = True
        return out

    async def _ask_for_prefill(self, url: str, body: dict) -> None:
        request_id = body["request_id"]
        try:
            if self._client is None:
                self._client = httpx.AsyncClient(timeout=self.post_timeout_s,
                                                 verify=client_context(self.settings.tls_ca) or True)
            r = await self._client.post(url, json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.text[:300]}")
            log.debug("prefill done for pushed request", request=request_id)
            with self._lock:
                self._prefilled.append(request_id)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the worker
            log.warning("metaserver could not get the prompt prefilled; the request falls back by policy",
                        request=request_id, error=str(exc))
            with self._lock:
                self._failed.append(request_id)

    # ---- per step -------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> PushMetadata:
        meta = PushMetadata(expect=self._expect, idle=not scheduler_output.total_num_scheduled_tokens)
        self._expect = {}
        with self._lock:
            meta.failed, self._failed = self._failed, []
            meta.prefilled, self._prefilled = self._prefilled, []
        meta.push += [self._abandon_plan(out) for out in self._finished_unpushed]
        self._finished_unpushed = []
        scheduled = scheduler_output.num_scheduled_tokens
        # per request: the first token whose block goes out this step, and the tokens computed before it
        spans: dict[str, tuple[int, int]] = {}
        for new in scheduler_output.scheduled_new_reqs:
            out = self._out.get(new.req_id)
            if out is not None:
                out.blocks = list(new.block_ids[0])
                # P's own prefix-cache hits (tokens computed before this step) are pushed too: D has none of them
                spans[new.req_id] = (0, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            out = self._out.get(req_id)
            if out is None:
                continue
            if cached.new_block_ids[i] is not None:
                out.blocks += list(cached.new_block_ids[i][0])
            spans[req_id] = (cached.num_computed_tokens[i], cached.num_computed_tokens[i])
        for req_id, (start, computed) in spans.items():
            out = self._out[req_id]
            if out.abandon:
                meta.push.append(self._abandon_plan(out))
                del self._out[req_id]
                continue
            end = min(computed + scheduled.get(req_id, 0), out.prompt_len)
            if end <= start and start > 0:
                continue
            first = max(out.skip, start // self.block_size)
            last_block = -(-end // self.block_size)  # exclusive
            remote = out.target.get("remote_block_ids") or []
            if remote and isinstance(remote[0], (list, tuple)):
                remote = remote[0]
            idx = range(first, last_block)
            done = end >= out.prompt_len
            meta.push.append(PushPlan(
                request_id=str(out.target.get("request_id")), local_blocks=[out.blocks[i] for i in idx],
                remote_blocks=[int(remote[i - out.skip]) for i in idx], host=str(out.target.get("remote_host")),
                port=int(out.target.get("remote_port")), last=done))
            if done:
                del self._out[req_id]
        return meta

    def _abandon_plan(self, out: _Outgoing) -> PushPlan:
        return PushPlan(str(out.target.get("request_id")), [], [], str(out.target.get("remote_host")),
                        int(out.target.get("remote_port")), last=True, abandon=True)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        # P pushed while computing (the worker copies pages out before the step ends), so
        # blocks are freed as usual. One that finished before its last push (aborted mid-prompt)
        # tells D at the next step, and D also stops waiting soon after the metaserver says the
        # prefill is over, whatever happened to the frames.
        out = self._out.pop(request.request_id, None)
        if out is not None:
            log.warning("prefill finished before its KV was pushed; decode is told to recompute",
                        request=request.request_id, decode_request=out.target.get("request_id"))
            self._finished_unpushed.append(out)
        return False, None

    def shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
