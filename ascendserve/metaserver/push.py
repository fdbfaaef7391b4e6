"""Push-mode rendezvous: the proxy announces a request, D asks, P is dispatched once.

    proxy  POST /v1/metaserver/expect   {request_id, engine_request_ids, path, body, prefill_url}
           -> {"ticket": T}; the proxy gives D  metaserver = ".../v1/metaserver?ticket=T"
    D      POST /v1/metaserver?ticket=T  PushPrefillRequest (vllm-ascend's layerwise body)
           -> waits until P has finished the prefill, then {"status": "ok"} (502 if P failed)

The ticket is a per-request capability: D's connector (ours or vllm-ascend's)
calls the URL it was given verbatim, so no cluster secret travels to D or
into its logs. A request with several prompts (completions with a list)
waits for every engine request id before P is dispatched, once, with
`batch_kv_transfer_params`. Expectations expire after `ttl_s`.
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ascendserve.protocol.kv_params import WILDCARD_HOSTS, PushPrefillRequest, base_request_id

PostJSON = Callable[[str, dict, dict], Awaitable[dict]]


class PushError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Expectation:
    request_id: str
    engine_ids: tuple[str, ...]
    path: str
    body: dict
    prefill_url: str
    ticket: str
    deadline: float
    params: dict[str, dict] = field(default_factory=dict)
    all_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


def prefill_body(body: dict, params: dict[str, dict], engine_ids: tuple[str, ...]) -> dict:
    out = copy.deepcopy(body)
    first = dict(params[engine_ids[0]])
    if len(engine_ids) > 1:
        first["batch_kv_transfer_params"] = {i: params[i] for i in engine_ids}
    out.update(kv_transfer_params=first, stream=False, max_tokens=1, min_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


class PushDispatcher:
    def __init__(self, post_json: PostJSON, ttl_s: float, clock=time.monotonic):
        self.post_json, self.ttl_s, self.clock = post_json, ttl_s, clock
        self._by_engine_id: dict[str, Expectation] = {}
        self.dispatched = 0

    def expect(self, request_id: str, engine_ids: list[str], path: str, body: dict, prefill_url: str) -> str:
        if not engine_ids:
            raise PushError(400, "engine_request_ids must not be empty")
        exp = Expectation(request_id, tuple(engine_ids), path, body, prefill_url.rstrip("/"),
                          secrets.token_urlsafe(16), self.clock() + self.ttl_s)
        for engine_id in engine_ids:
            old = self._by_engine_id.get(engine_id)
            if old is not None and old.task is not None and not old.task.done():
                raise PushError(409, f"request {engine_id} is being prefilled")
            self._by_engine_id[engine_id] = exp
        return exp.ticket

    async def ask(self, ticket: str, req: PushPrefillRequest) -> dict:
        key = req.request_id
        if key not in self._by_engine_id:  # D's id may carry vLLM's random suffix; P needs it as sent
            key = base_request_id(key)
        exp = self._by_engine_id.get(key)
        if exp is None or exp.deadline < self.clock():
            raise PushError(404, f"unknown or expired request id {req.request_id!r}")
        if not secrets.compare_digest(ticket.encode(errors="surrogatepass"), exp.ticket.encode()):  # str: ASCII only
            raise PushError(403, "invalid ticket for this request")
        if req.remote_host in WILDCARD_HOSTS:
            raise PushError(400, f"remote_host {req.remote_host!r} is a wildcard address; "
                                 "prefill must be able to reach decode")
        exp.params[key] = _params(req)
        if all(i in exp.params for i in exp.engine_ids):
            if exp.task is None or (exp.task.done() and exp.task.exception() is not None):
                exp.task = asyncio.ensure_future(self._dispatch(exp))
            exp.all_arrived.set()
        remaining = max(0.0, exp.deadline - self.clock())
        try:
            await asyncio.wait_for(exp.all_arrived.wait(), remaining)
        except TimeoutError:
            raise PushError(504, "the request's other prompts never asked for prefill") from None
        try:
            await asyncio.shield(exp.task)
        except PushError:
            raise
        except Exception as exc:
            raise PushError(502, f"prefill failed: {exc}") from None
        return {"status": "ok"}

    async def _dispatch(self, exp: Expectation) -> dict:
        body = prefill_body(exp.body, exp.params, exp.engine_ids)
        result = await self.post_json(exp.prefill_url + exp.path, body, {"x-request-id": exp.request_id})
        self.dispatched += 1
        return result

    def expire(self) -> int:
        now = self.clock()
        gone = [i for i, e in self._by_engine_id.items()
                if e.deadline < now and (e.task is None or e.task.done())]
        for engine_id in gone:
            del self._by_engine_id[engine_id]
        return len(gone)

    def pending(self) -> int:
        return len({id(e) for e in self._by_engine_id.values()})


def _params(req: PushPrefillRequest) -> dict:
    import msgspec

    return msgspec.to_builtins(req)
