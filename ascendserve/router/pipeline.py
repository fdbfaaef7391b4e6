"""One client request through the topology: E -> (P -> D | PD).

Life cycle of a request (each hop picks the least-loaded instance of its
role and holds a Lease on it for exactly as long as it uses it):

    encode     only when the request has multimodal parts and encoders exist
               (router/encode.py); its ec_transfer_params go on to P/PD.
    prefill    by the KV connector P and D run (router/kv_flow.py; P and D of
               different connectors are never paired). pull/named/store: P
               computes the prompt with max_tokens=1 (pull: P returns
               kv_transfer_params for D); P keeps a KV hold on its lease until D
               has produced its first byte (D has the blocks by then).
               push: skipped here; D asks the metaserver, which dispatches P.
    decode     the client's request (plus kv_transfer_params) to D or PD.
               Streaming (router/sse.py; the ledger's relay: router/migrate.py):
               the response is committed only after D's first chunk, so every
               failure before it is retried on another instance; a
               failure after it ends the stream with an OpenAI error event.

Retries: connection errors and 5xx, with exponential backoff, preferring an
instance not tried yet; never on 4xx. Traces (router/tracing.py, when OTEL_* turns them
on): a span per attempt at a hop (`_hop`), its traceparent on the engine's request.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
import structlog

from ascendserve.config import ProxyConfig
from ascendserve.connectors.transport.channel import free_remote
from ascendserve.protocol import kv_params
from ascendserve.protocol.wire import decode_json
from ascendserve.protocol.openai import APIError, estimated_tokens, max_new_tokens
from ascendserve.router import kv_flow, ledger, sse, tracing
from ascendserve.router.ec import ECLookup
from ascendserve.router.encode import Encoders
from ascendserve.router.kv_flow import Pair, Pairing
from ascendserve.router.metrics import ProxyMetrics
from ascendserve.router.kv_route import KVRouter, Plan
from ascendserve.router.migrate import Generation, Leg, parse
from ascendserve.router.pools import Instance, Lease, Pool, Pools
from ascendserve.web.upstream import Upstream, UpstreamError

log = structlog.get_logger("ascendserve.router")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
Choose = Callable[[Pool, frozenset[str]], Instance | None]


@dataclass
class Reply:
    """What the handler sends back: a JSON body, or an SSE byte stream."""

    status: int = 200
    body: dict | None = None
    stream: AsyncIterator[bytes] | None = None
    backend: str = ""


class Pipeline:
    def __init__(self, pools: Pools, upstream: Upstream, settings: ProxyConfig, metrics: ProxyMetrics,
                 on_unreachable: Callable[[Instance], None], metaserver_url: str = "", cluster_token: str = "",
                 ec_lookup: ECLookup | None = None, on_stall: Callable[[Instance], None] | None = None,
                 check_now: Callable[[], None] | None = None, kv_router: KVRouter | None = None,
                 metaservers: Callable[[], list[str]] | None = None, tracer: tracing.Tracing | None = None):
        self.pools, self.upstream, self.settings, self.metrics = pools, upstream, settings, metrics
        self.ec_lookup = ec_lookup
        self.encoders = Encoders(pools, settings, metrics, ec_lookup, self._encode_call)
        self.tracing = tracer  # None: traces off
        self.on_unreachable = on_unreachable
        self.on_stall = on_stall or on_unreachable
        self.check_now = check_now or (lambda: None)
        url = metaserver_url.rstrip("/")
        # push mode: the metaservers to ask, in order (the registry's, or cluster.metaserver_url)
        self.metaservers = metaservers or (lambda: [url] if url else [])
        self._next_metaserver = 0
        self.metaserver_headers = {"authorization": f"Bearer {cluster_token}"} if cluster_token else {}
        self.cluster_token = cluster_token
        self._frees: set[asyncio.Future] = set()
        self.pairing = Pairing(settings.mode)
        self.kv_router = kv_router if settings.routing == "kv" else None

    # ---- entry -------------------------------------------------------------
    async def handle(self, kind: str, body: dict, request_id: str, client_headers=None) -> Reply:
        """One request; `client_headers` may carry a traceparent to continue."""
        if self.tracing is not None:
            return await self.tracing.handle(kind, body, request_id, client_headers, self._route)
        return await self._route(kind, body, request_id)

    async def _route(self, kind: str, body: dict, request_id: str) -> Reply:
        model = body["model"]
        known = self.pools.models()
        if known and model not in known:
            raise APIError(404, f"The model '{model}' does not exist; available: {', '.join(known)}",
                           code="model_not_found")
        headers = {"x-request-id": request_id}
        tokens = estimated_tokens(body)
        if kind == "chat":
            ec_params = await self.encoders.run(body, headers)
            if ec_params:
                body = dict(body, ec_transfer_params=ec_params)
        disaggregated = self.pools.has_active("prefill") and self.pools.has_active("decode")
        plan = None
        if self.kv_router is not None and (disaggregated or self.pools.has_active("pd")):
            plan = await self.kv_router.plan(kind, body, "prefill" if disaggregated else "pd", headers)
            if plan is not None:
                tokens = plan.prompt_tokens
        if disaggregated:
            pair = self._pair()
            if pair.flow == "push" and not self.metaservers():
                raise APIError(503, f"prefill and decode run a push connector ({pair.connector or self.settings.mode}): "
                               "the proxy needs --metaserver-url", type="service_unavailable", code="no_metaserver")
            if pair.flow == "push":
                return await self._push(kind, body, headers, tokens, request_id, pair, plan)
            return await self._prefill_then_decode(kind, body, headers, tokens, pair, plan)
        if self.pools.has_active("pd"):
            return await self._decode(kind, "pd", body, headers, tokens, plan=plan)
        raise APIError(503, "no healthy instance can serve this request (need pd, or prefill and decode)",
                       type="service_unavailable", code="no_instance")

    def push_missing(self) -> str | None:
        """Why push mode cannot serve yet (no metaserver known) when P and D would pair over a push
        connector; None otherwise. /health says it: a proxy is not ready while every request would
        get 503 no_metaserver (a metaserver announces itself a beat after it is up)."""
        if not (self.pools.has_active("prefill") and self.pools.has_active("decode")) or self.metaservers():
            return None
        try:
            pair = self.pairing.pair(self.pools["prefill"].active(), self.pools["decode"].active(), lambda _: None)
        except APIError:
            return None  # a connector mismatch: requests say it
        if pair.flow != "push":
            return None
        connector = pair.connector or self.settings.mode
        return (f"no metaserver known: prefill and decode run a push connector ({connector}) and the proxy "
                "has no metaserver to announce requests to")

    def _pair(self) -> Pair:
        """This request's KV connector and flow, and the P and D that cannot take part
        (router/kv_flow.py): 503 when no prefill and decode share a connector."""
        return self.pairing.pair(self.pools["prefill"].active(), self.pools["decode"].active(),
                                 self.pools["prefill"].select)

    # ---- retries -----------------------------------------------------------
    def _chooser(self, plan: Plan | None) -> Choose | None:
        """How this request's instance is chosen: by the KV plan, or (None) by load."""
        if plan is not None and self.kv_router is not None:
            return lambda pool, tried: self.kv_router.pick(plan, pool, tried)
        return None

    async def _with_retries(self, role: str, attempt: Callable[[Pool, Instance], Awaitable],
                            choose: Choose | None = None, exclude: frozenset[str] = frozenset()):
        pool = self.pools[role]
        tried: set[str] = set(exclude)
        last: UpstreamError | None = None
        for n in range(self.settings.max_retries + 1):
            if choose is not None:
                inst = choose(pool, frozenset(tried))
            else:
                inst = pool.select(frozenset(tried))
            inst = inst or pool.select(exclude)
            if inst is None:
                break
            tried.add(inst.url)
            try:
                return await attempt(pool, inst)
            except UpstreamError as exc:
                if exc.client_error:
                    raise APIError(exc.status, _client_message(exc), code=str(exc.status)) from None
                if exc.status is None:
                    self.on_unreachable(inst)
                last = exc
                self.metrics.retries.labels(role).inc()
                log.warning("backend hop failed", role=role, url=inst.url, status=exc.status,
                            detail=exc.detail[:200], attempt=n + 1)
                if n < self.settings.max_retries:
                    await asyncio.sleep(self.settings.retry_backoff_s * (2 ** n))
        detail = f"{role} unavailable" + (f": {last.detail[:200]}" if last else ": no active instance")
        raise APIError(502 if last else 503, detail, type="service_unavailable", code="backend_unavailable")

    async def _post_leased(self, pool: Pool, inst: Instance, path: str, body: dict, headers: dict,
                           cost: int) -> tuple[dict, Instance]:
        """One JSON hop, holding `cost` tokens of load on `inst` while it runs."""
        lease = pool.lease(inst, cost)
        ok = False
        try:
            with self._hop(pool, inst) as hop:
                result = await self.upstream.post_json(inst.url + path, body, hop.headers(headers))
            ok = True
            return result, inst
        finally:
            lease.release(ok=ok)

    def _hop(self, pool: Pool, inst: Instance):
        """This attempt's span (tracing.Hop; NO_HOP, which does nothing, when traces are off)."""
        return tracing.NO_HOP if self.tracing is None else self.tracing.hop(pool.role, inst.url)

    async def _encode_call(self, body: dict, headers: dict, cost: int) -> dict:
        reply, _ = await self._with_retries(
            "encoder", lambda pool, inst: self._post_leased(pool, inst, PATHS["chat"], body, headers, cost))
        return reply

    # ---- prefill (pull) -----------------------------------------------------
    async def _prefill_then_decode(self, kind: str, body: dict, headers: dict, tokens: int, pair: Pair,
                                   plan: Plan | None = None) -> Reply:
        """P first (pull, named, store flows: router/kv_flow.py), then D with what P's
        answer and the flow give it."""
        p_body = kv_flow.prefill_body(pair, body, headers["x-request-id"])
        choose = self._chooser(plan)
        p_reply, p_inst = await self._with_retries(
            "prefill", lambda pool, inst: self._post_leased(pool, inst, PATHS[kind], p_body, headers, tokens),
            choose, exclude=pair.p_out)
        if plan is not None and self.kv_router is not None:
            self.kv_router.routed(plan)
        self.metrics.observe_cached("prefill", p_reply.get("usage") if isinstance(p_reply, dict) else None)
        hold = self.pools["prefill"].lease(p_inst, 0, kv=tokens)  # P keeps the KV until D has it
        if self.tracing is not None:
            hold = self.tracing.hold(hold, "kv_transfer", **{"ascendserve.kv.flow": pair.flow})
        d_body = dict(body)
        d_body.pop("ec_transfer_params", None)  # D has no EC connector
        try:
            d_params = kv_flow.decode_params(pair, p_inst, p_reply, headers["x-request-id"])
        except BaseException:
            hold.release()
            raise
        if d_params is not None:
            d_body["kv_transfer_params"] = d_params
        return await self._decode_holding(kind, d_body, headers, tokens, hold, pair, plan)

    async def _decode_holding(self, kind: str, d_body: dict, headers: dict, tokens: int, hold: Lease,
                              pair: Pair, plan: Plan | None = None) -> Reply:
        """Decode while P's KV hold stays on P's load until D's first byte. D by load, or by its
        cached blocks where decode instances publish KV events (decode-side prefix caching)."""
        try:
            d_plan = None
            if plan is not None and self.kv_router is not None and \
                    any(i.cache is not None for i in self.pools["decode"].active()):
                d_plan = await self.kv_router.plan(kind, d_body, "decode", headers, known=(plan.ids, plan.source))
            return await self._decode(kind, "decode", d_body, headers, tokens, on_first_byte=hold.release,
                                      exclude=pair.d_out, plan=d_plan)
        except BaseException:  # D failed or the client went away: P need not wait for its deadline
            if pair.free == "side-channel":  # ours: P frees at once; the others by lease or TTL
                self._free_prefill_kv(d_body.get("kv_transfer_params"))
            raise
        finally:
            if d_body.get("stream") is not True:
                hold.release()

    def _free_prefill_kv(self, params: dict | None) -> None:
        """Tell P (our pull connector's side channel) to release a hold at once; best effort."""
        if not self.cluster_token or not isinstance(params, dict):
            return
        host, port, remote_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(remote_id, str)):
            return
        ranks = params.get("remote_ptp_size") if isinstance(params.get("remote_ptp_size"), int) else 1
        future = asyncio.get_running_loop().run_in_executor(
            None, free_remote, self.cluster_token, host, port, remote_id, max(1, ranks))
        self._frees.add(future)
        future.add_done_callback(self._frees.discard)

    # ---- push ----------------------------------------------------------------
    async def _push(self, kind: str, body: dict, headers: dict, tokens: int, request_id: str, pair: Pair,
                    plan: Plan | None = None) -> Reply:
        """Pick P now, tell the metaserver, send D a callback URL with a one-request ticket."""
        pool = self.pools["prefill"]
        inst = self.kv_router.pick(plan, pool, pair.p_out) if plan is not None and self.kv_router else None
        inst = inst or pool.select(pair.p_out)
        if plan is not None and self.kv_router is not None and plan.chosen is inst:
            self.kv_router.routed(plan)
        if inst is None:
            raise APIError(503, "no active prefill instance", type="service_unavailable", code="no_instance")
        hold = pool.lease(inst, tokens, kv=tokens)
        if self.tracing is not None:  # the metaserver dispatches P when D calls back: one span to D's first byte
            hold = self.tracing.hold(hold, "prefill", **{"ascendserve.kv.flow": "push"})
        expect = {"request_id": request_id, "path": PATHS[kind], "body": body, "prefill_url": inst.url,
                  "engine_request_ids": kv_params.engine_request_ids(kind, request_id, body)}
        try:
            metaserver, answer = await self._expect(expect, headers)
        except UpstreamError as exc:
            hold.release(ok=False)
            raise APIError(502, f"metaserver unavailable for push mode: {exc.detail[:200]}",
                           type="service_unavailable", code="metaserver_unavailable") from None
        # the ticket lives in the metaserver that issued it: D calls that one
        callback = f"{metaserver}/v1/metaserver?ticket={answer['ticket']}"
        d_body = dict(body, kv_transfer_params=kv_params.push_decode_params(callback))
        d_body.pop("ec_transfer_params", None)  # for P (through the metaserver), not D
        return await self._decode_holding(kind, d_body, headers, tokens, hold, pair, plan)

    async def _expect(self, expect: dict, headers: dict) -> tuple[str, dict]:
        """Announce a push request to a metaserver, the next one after a failure to reach one (they
        take turns, so each holds a share of the tickets); refusals (4xx) are final."""
        urls = self.metaservers()
        if not urls:
            raise UpstreamError("metaserver", None, "no metaserver registered")
        start = self._next_metaserver = (self._next_metaserver + 1) % len(urls)
        error = None
        for url in urls[start:] + urls[:start]:
            try:
                return url, await self.upstream.post_json(url + "/v1/metaserver/expect", expect,
                                                          {**headers, **self.metaserver_headers})
            except UpstreamError as exc:
                if exc.client_error:
                    raise
                error = exc
        raise error

    # ---- decode ------------------------------------------------------------
    async def _decode(self, kind: str, role: str, body: dict, headers: dict, tokens: int,
                      on_first_byte: Callable[[], None] | None = None, exclude: frozenset[str] = frozenset(),
                      plan: Plan | None = None) -> Reply:
        cost = tokens + max_new_tokens(body)
        started = time.monotonic()
        key = self._chooser(plan)
        mode = ledger.mode_of(kind, body) if self.settings.migration_limit else None
        if mode is not None:
            return await self._generate(kind, role, body, headers, cost, started, key, on_first_byte, exclude, mode,
                                        plan)
        if body.get("stream") is not True:
            result, inst = await self._with_retries(
                role, lambda pool, inst: self._post_leased(pool, inst, PATHS[kind], body, headers, cost), key,
                exclude)
            self._sent(plan)
            self._answered(role, plan, result.get("usage") if isinstance(result, dict) else None, None)
            if inst.cache is not None and inst.cache.details_added and isinstance(result.get("usage"), dict):
                result["usage"]["prompt_tokens_details"] = None  # vLLM's null: the client did not turn it on
            self.metrics.observe_done(started)
            return Reply(body=result, backend=inst.url)

        async def attempt_stream(pool: Pool, inst: Instance):
            lease = pool.lease(inst, cost)
            hop = self._hop(pool, inst)  # ends with the stream (tracing.RequestTrace.streamed)
            try:
                response = await self.upstream.open_stream(inst.url + PATHS[kind], body, hop.headers(headers))
                try:
                    first = await sse.first_chunk(response, inst.url)
                except BaseException:
                    response.close()
                    raise
            except BaseException as exc:
                lease.release(ok=False)
                hop.end(exc)
                raise
            hop.event("first_byte")
            return lease, response, first

        try:
            lease, response, first = await self._with_retries(role, attempt_stream, key, exclude)
        except BaseException:
            if on_first_byte:
                on_first_byte()
            raise
        self._sent(plan)
        if on_first_byte:
            on_first_byte()
        self.metrics.ttft.observe(time.monotonic() - started)
        return Reply(stream=sse.relay(self.metrics, lease, response, first, started, kind, headers["x-request-id"]),
                     backend=lease.instance.url)

    # ---- a generation that survives its instance (router/ledger.py, router/migrate.py) ----
    def _sent(self, plan: Plan | None) -> None:
        """A planned pd/decode hop was sent: what the plan predicted is counted."""
        if plan is not None and self.kv_router is not None:
            self.kv_router.routed(plan)

    def _answered(self, role: str, plan: Plan | None, usage: dict | None, prompt_ids: list[int] | None) -> None:
        """A pd/decode hop answered: what the engine says it had cached, and a check of locally
        computed token ids against the engine's."""
        if plan is not None and self.kv_router is not None:
            self.kv_router.check_ids(plan, prompt_ids)
        if usage is not None and role == "pd":
            self.metrics.observe_cached(role, usage)

    async def _generate(self, kind: str, role: str, body: dict, headers: dict, cost: int, started: float,
                        key: Choose | None, on_first_byte: Callable[[], None] | None, exclude: frozenset[str],
                        mode: str, plan: Plan | None = None) -> Reply:
        led = ledger.Ledger(kind, body, mode=mode)
        request_id = headers["x-request-id"]

        async def open_leg(leg_role: str, leg_body: dict, tried: frozenset[str]):
            path = PATHS[kind] if not led.on_continuation or led.mode == "replay" else PATHS["completions"]
            if leg_role == "decode" and led.on_continuation and led.mode == "tokens" \
                    and len(leg_body["prompt"]) >= self.settings.migrate_via_prefill_tokens:
                via = await self._via_prefill(leg_body, headers, cost, led.migrations)
                if via is not None:
                    leg_body, tried = via[0], tried | via[1]
            return await self._with_retries(
                leg_role, lambda pool, inst: self._open_leg(pool, inst, path, leg_body, headers, cost),
                key if not led.on_continuation else None, tried)

        try:
            leg, evs, done = await open_leg(role, ledger.backend_body(body), exclude)
        finally:
            if on_first_byte:
                on_first_byte()
        if led.stream:
            self.metrics.ttft.observe(time.monotonic() - started)
        self._sent(plan)
        led.strip_details = bool(leg.instance.cache is not None and leg.instance.cache.details_added)
        gen = Generation(led, role, leg, evs, done, open_leg, self._pick, self._detokenize, self.settings,
                         self.metrics, self._stalled, lambda inst: self.check_now(), request_id)
        if led.stream:
            report = functools.partial(self._reported, gen, started, kind, request_id, plan)
            return Reply(stream=gen.run(report), backend=leg.instance.url)
        async for _ in gen.run():
            pass
        self._answered(role, plan, led.engine_usage, led.prompt_ids)
        if gen.error:
            raise APIError(502, gen.error, type="service_unavailable", code="backend_failed")
        self.metrics.observe_done(started)
        return Reply(body=led.response(), backend=gen.leg.instance.url)

    async def _via_prefill(self, body: dict, headers: dict, cost: int,
                           migration: int) -> tuple[dict, frozenset[str]] | None:
        """A long continuation through a prefill instance (its prefix cache still holds the prompt;
        D pulls the KV): D's body and the D that cannot pair, or None to let D recompute it alone
        (no prefill of a pull/named/store flow, or the prefill hop failed)."""
        request_id = f"{headers['x-request-id']}-m{migration}"
        try:
            pair = self._pair()
            if pair.flow not in ("pull", "named", "store"):
                return None
            p_body = kv_flow.prefill_body(pair, body, request_id)
            p_reply, p_inst = await self._with_retries(
                "prefill", lambda pool, inst: self._post_leased(pool, inst, PATHS["completions"], p_body,
                                                                 headers, cost), exclude=pair.p_out)
            d_params = kv_flow.decode_params(pair, p_inst, p_reply, request_id)
        except APIError as exc:
            log.info("continuation recomputed on decode: the prefill hop failed", detail=exc.message[:200])
            return None
        log.info("continuation through prefill", request_id=headers["x-request-id"], prefill=p_inst.url,
                 tokens=len(body["prompt"]))
        return (dict(body, kv_transfer_params=d_params) if d_params is not None else body), pair.d_out

    async def _open_leg(self, pool: Pool, inst: Instance, path: str, body: dict, headers: dict, cost: int):
        """Open one engine stream and read its first whole events; an error event first is a
        failed hop like a 5xx (retried elsewhere; a 4xx one goes to the client)."""
        lease = pool.lease(inst, cost)
        hop = self._hop(pool, inst)  # ends with the stream, or when the leg breaks (migrate.py)
        try:
            response = await self.upstream.open_stream(inst.url + path, body, hop.headers(headers))
            leg = Leg(lease, response, sse.SSEFramer())
            try:
                evs, done, ended = await leg.next_events(self.settings.request_timeout_s)
                while not evs and not done and not ended:
                    evs, done, ended = await leg.next_events(self.settings.request_timeout_s)
                if not evs:
                    raise UpstreamError(inst.url, None, "stream ended before the first event")
                evs[0] = parse(evs[0])  # the ledger takes it decoded: it sets the response's head
                error = ledger.error_of(evs[0])
                if error is not None:  # 4xx goes to the client, anything else is retried
                    status = error[1] if error[1] is not None and error[1] >= 400 else 502
                    raise UpstreamError(inst.url, status, f"error event first: {error[0][:200]}",
                                        msgspec.json.encode(evs[0]))
            except ledger.BackendFailed as failed:
                response.close()
                raise UpstreamError(inst.url, None, f"stream broke before the first event: {failed.detail}") from None
            except BaseException:
                response.close()
                raise
        except BaseException as exc:
            lease.release(ok=False)
            hop.end(exc)
            raise
        hop.event("first_byte")
        return leg, evs, done

    def _pick(self, role: str, tried: frozenset[str]) -> Instance | None:
        pool = self.pools[role]
        return pool.select(tried) or pool.select()

    async def _detokenize(self, inst: Instance | None, ids: list[int]) -> str | None:
        """The text of token ids, from an engine's /detokenize (None if it cannot say)."""
        if inst is None:
            return None
        try:
            reply = await self.upstream.post_json(inst.url + "/detokenize", {"model": inst.models[0] if inst.models
                                                                             else "", "tokens": ids}, {})
        except UpstreamError as exc:
            log.info("detokenize failed", url=inst.url, detail=exc.detail[:200])
            return None
        text = reply.get("prompt") if isinstance(reply, dict) else None
        return text if isinstance(text, str) else None

    def _stalled(self, inst: Instance) -> None:
        """An instance went silent past the stall deadline while generating: check its health now."""
        log.warning("instance stalled; checking its health now", url=inst.url, role=inst.role)
        self.on_stall(inst)

    def _reported(self, gen: Generation, started: float, kind: str, request_id: str, plan: Plan | None,
                  failure: BaseException | None) -> None:
        """A streamed generation's end (Generation.run's report): its metrics and its log line."""
        if failure is None and not gen.error:
            outcome = "ok"
            self.metrics.observe_done(started, gen.answered_at)
            self.metrics.observe_itl(gen.first_at, len(gen.ledger.generated), gen.answered_at)
            self._answered(gen.role, plan, gen.ledger.engine_usage, gen.ledger.prompt_ids)
        elif isinstance(failure, (asyncio.CancelledError, GeneratorExit)):
            outcome = "client_disconnected"
            self.metrics.cancelled.inc()
        else:
            outcome = "backend_failed"
        log.info("request", request_id=request_id, route=kind, status=200, stream=True,
                 backend=gen.leg.instance.url, outcome=outcome, migrations=gen.ledger.migrations,
                 duration_ms=round(((gen.answered_at or time.monotonic()) - started) * 1000, 2))


def _client_message(exc: UpstreamError) -> str:
    try:
        body = decode_json(exc.body)
        message = body.get("error", {}).get("message") or body.get("message") or body.get("detail")
        if message:
            return str(message)
    except (msgspec.DecodeError, AttributeError):
        pass
    return exc.detail or f"backend returned {exc.status}"
