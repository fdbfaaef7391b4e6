"""A fast fake engine instance that speaks the P/D/E/PD HTTP protocol (no model).

    python -m tests.stub_backend --role decode --port 9001 [--tokens 16] [--token-delay-ms 0]

The proxy is the thing under test; this stands in for vLLM where a test or a
benchmark needs thousands of requests, exact failure timing, or a process to
SIGKILL. It checks the protocol it receives and counts what happened:
    prefill  must get max_tokens=1, stream=false, kv_transfer_params.do_remote_decode
    decode   with --require-kv, must get P's kv_transfer_params (or a push-mode
             metaserver URL, which it calls back like vllm-ascend's layerwise D)
With --kv-connector NAME it speaks that connector's flow (protocol/kv_connectors.py):
it says so at GET /kv_info as an engine role does; pull P answers with the field names of
that connector's own P (tests/kv_wire.py: NixlConnector's tp_size, vllm-ascend's
remote_ptp_size, ...), and a D checks it got those params exactly; named P and D (vLLM's
MooncakeConnector) must get the transfer id the proxy minted, D with P's engine id and
bootstrap URL; store P and D must get no kv_transfer_params. A pull P
also listens on the remote_port it names and counts the connections made to it (the
proxy's FREE of a hold: `side_channel_connections`). --fail-status N: every generation
request is answered N (a dead D); --first-event-error: every stream answers 200 and an error
event first. With return_token_ids a stream carries token ids as vLLM's do (made-up ones).
`last_kv_transfer_params` is what the last request carried, `last_traceparent` its W3C
traceparent header (None without one).
GET /stub/stats returns the counters (and `peak_active`, the most streams open at
once); POST /stub/reset clears them. A reset body {"gate": N} makes every stream
wait after its first token until N streams are open at once (or --gate-timeout-s
passes), so a load test can prove that N streams really were concurrent.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

import aiohttp
import msgspec

from tests import kv_wire

STATS_KEYS = ("requests", "completed", "aborted", "protocol_errors", "prefills", "decodes", "encodes",
              "push_callbacks", "active", "peak_active", "gate_timeouts", "side_channel_connections",
              "generation_connections")

class Stub:
    def __init__(self, args):
        self.args = args
        self.stats = dict.fromkeys(STATS_KEYS, 0)
        self.peers: set = set()  # the connections generation requests came on (client address and port)
        self.ids = itertools.count()
        self.session: aiohttp.ClientSession | None = None
        self.gate = 0
        self.gate_open = asyncio.Event()
        from ascendserve.protocol.kv_connectors import flow_of, free_of

        children = args.kv_connectors.split(",") if args.kv_connectors else []
        self.flow = flow_of(args.kv_connector, children) if args.kv_connector else ""
        self.free = free_of(args.kv_connector, children) if args.kv_connector else ""
        # multi answers with the kv_transfer_params of its child that moves KV from P to D
        self.speaks = next((c for c in children if flow_of(c) != "store"), "") if children else args.kv_connector
        self.side_port = 0
        if args.role == "prefill" and self.flow in ("pull", "named"):  # a side channel that only counts connections
            import socket
            import threading

            listener = socket.create_server(("127.0.0.1", 0))
            self.side_port = listener.getsockname()[1]

            def count():
                while True:
                    conn, _ = listener.accept()
                    self.stats["side_channel_connections"] += 1
                    conn.close()

            threading.Thread(target=count, daemon=True).start()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if self.session:
                        await self.session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/health", "/metrics", "/ping"):
            return await self._reply(send, 200, b"")
        if method == "GET" and path == "/kv_info" and self.args.kv_connector:
            return await self._json(send, {"connector": self.args.kv_connector, "flow": self.flow, "free": self.free,
                                           "connectors": self.args.kv_connectors.split(",") if self.args.kv_connectors
                                           else [],
                                           "engine_id": "stub-engine", "host": "127.0.0.1", "port": self.side_port})
        if method == "GET" and path == "/v1/models":
            return await self._json(send, {"object": "list", "data": [{"id": self.args.model, "object": "model"}]})
        if path == "/stub/stats":
            return await self._json(send, self.stats)
        if path == "/stub/reset":
            body = await self._body(receive)
            self.stats = dict.fromkeys(STATS_KEYS, 0)
            self.peers.clear()
            self.gate = int(msgspec.json.decode(body).get("gate", 0)) if body else 0
            self.gate_open.clear()
            return await self._json(send, self.stats)
        if method == "POST" and path in ("/start_profile", "/stop_profile", "/reset_prefix_cache"):
            return await self._reply(send, 200, b"")
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            raw = await self._body(receive)
            self.peers.add(tuple(scope.get("client") or ()))
            self.stats["generation_connections"] = len(self.peers)
            headers = dict(scope["headers"])
            return await self._generate(path, msgspec.json.decode(raw), headers, receive, send)
        return await self._json(send, {"error": {"message": "not found"}}, 404)

    @staticmethod
    async def _body(receive) -> bytes:
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                return raw

    async def _reply(self, send, status: int, body: bytes, ctype: bytes = b"application/json"):
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": body})

    async def _json(self, send, obj, status: int = 200):
        await self._reply(send, status, msgspec.json.encode(obj))

    def _bad(self, message: str):
        self.stats["protocol_errors"] += 1
        return {"error": {"message": message, "type": "invalid_request_error", "code": "400"}}

    async def _generate(self, path, body, headers, receive, send):
        self.stats["requests"] += 1
        self.stats["last_request_at"] = time.time()
        self.stats["last_ec_transfer_params"] = body.get("ec_transfer_params")
        role, kv = self.args.role, body.get("kv_transfer_params") or {}
        self.stats["last_kv_transfer_params"] = body.get("kv_transfer_params")
        self.stats["last_traceparent"] = headers.get(b"traceparent", b"").decode() or None
        chat = path.endswith("chat/completions")
        rid = headers.get(b"x-request-id", b"").decode() or f"stub{next(self.ids)}"
        if self.args.fail_status:
            return await self._json(send, {"error": {"message": "stub told to fail"}}, self.args.fail_status)
        if role == "prefill" and self.flow in ("store", "named"):
            want = None if self.flow == "store" else {"do_remote_decode": True, "do_remote_prefill": False,
                                                      "transfer_id": kv.get("transfer_id")}
            if body.get("max_tokens") != 1 or body.get("stream") or body.get("kv_transfer_params") != want \
                    or (want and not str(want["transfer_id"]).startswith("xfer-")):
                return await self._json(send, self._bad(f"{self.flow}-flow prefill needs max_tokens=1, stream=false "
                                                        f"and kv_transfer_params {want}"), 400)
            self.stats["prefills"] += 1
            return await self._json(send, self._completion(chat, rid, 1))
        if role == "prefill":
            if body.get("max_tokens") != 1 or body.get("stream") or not kv.get("do_remote_decode"):
                return await self._json(send, self._bad("prefill needs max_tokens=1, stream=false, "
                                                        "kv_transfer_params.do_remote_decode"), 400)
            self.stats["prefills"] += 1
            reply = self._completion(chat, rid, 1)
            reply["kv_transfer_params"] = kv_wire.p_reply(self.speaks, rid, self.side_port) or {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
                "remote_engine_id": f"stub-{self.args.port}", "remote_request_id": rid,
                "remote_host": "127.0.0.1", "remote_port": self.side_port or self.args.port}
            return await self._json(send, reply)
        # a token-id prompt is the proxy continuing a request that broke mid-stream elsewhere
        # (router/migrate.py): D recomputes it, no P is involved
        continuation = _is_token_prompt(body.get("prompt"))
        if role == "decode" and self.args.require_kv and self.flow and not continuation:
            why = self._decode_params_wrong(body)
            if why:
                return await self._json(send, self._bad(why), 400)
        if role == "encoder":
            self.stats["encodes"] += 1
            reply = self._completion(chat, rid, 1)
            reply["ec_transfer_params"] = {f"stub-hash-{self.stats['encodes']}": {"item_indices": [0]}}
            return await self._json(send, reply)
        if role == "decode" and self.args.require_kv and self.flow in ("", "push") and not continuation:
            if kv.get("metaserver"):
                ok = await self._push_callback(kv["metaserver"], chat, rid)
                if not ok:
                    return await self._json(send, self._bad("push prefill failed"), 502)
            elif not kv.get("do_remote_prefill") or kv.get("remote_request_id") is None:
                return await self._json(send, self._bad("decode got no kv_transfer_params from prefill"), 400)
        self.stats["decodes"] += 1
        n = body.get("max_tokens") or body.get("max_completion_tokens") or self.args.tokens
        if body.get("stream"):
            if self.args.first_event_error:
                return await self._first_event_error(send)
            ids = _stub_token_ids(body) if body.get("return_token_ids") else None
            return await self._stream(receive, send, chat, rid, n, ids)
        if self.args.token_delay_ms:
            await asyncio.sleep(self.args.token_delay_ms * n / 1000)
        self.stats["completed"] += 1
        return await self._json(send, self._completion(chat, rid, n))

    def _decode_params_wrong(self, body: dict) -> str | None:
        """Why D's kv_transfer_params are not what its connector's flow gives D (None: they are)."""
        kv = body.get("kv_transfer_params")
        if self.flow == "store":
            return "store-flow decode got kv_transfer_params" if "kv_transfer_params" in body else None
        if self.flow == "named":
            keys = {"do_remote_decode", "do_remote_prefill", *kv_wire.VLLM_MOONCAKE_D_NEEDS}
            ok = isinstance(kv, dict) and set(kv) == keys and kv["do_remote_prefill"] is True \
                and kv["remote_engine_id"] == "stub-engine" and str(kv["transfer_id"]).startswith("xfer-") \
                and str(kv["remote_bootstrap_addr"]).startswith("http://127.0.0.1:")
            return None if ok else f"named-flow decode got kv_transfer_params {kv}"
        want = kv_wire.p_reply(self.speaks, "r", 1)
        if want is not None and (not isinstance(kv, dict) or set(kv) != set(want)):
            return f"decode got kv_transfer_params {sorted(kv or ())}, not P's {sorted(want)}"
        return None

    async def _push_callback(self, url: str, chat: bool, rid: str) -> bool:
        self.stats["push_callbacks"] += 1
        if self.session is None:
            self.session = aiohttp.ClientSession()
        body = {"request_id": f"chatcmpl-{rid}" if chat else f"cmpl-{rid}-0", "token_ids": [],
                "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[4, 5]],
                "remote_block_size": [16], "remote_engine_id": f"stub-{self.args.port}",
                "remote_host": "127.0.0.1", "remote_port": self.args.port, "remote_tp_size": 1,
                "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_cached_tokens": 0}
        async with self.session.post(url, json=body) as r:
            return r.status == 200

    def _completion(self, chat: bool, rid: str, n: int) -> dict:
        usage = {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
        if chat:
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.args.model, "usage": usage,
                    "choices": [{"index": 0, "finish_reason": "length",
                                 "message": {"role": "assistant", "content": "tok " * n}}]}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()),
                "model": self.args.model, "usage": usage,
                "choices": [{"index": 0, "text": "tok " * n, "finish_reason": "length"}]}

    async def _pass_gate(self) -> None:
        """Wait until `gate` streams are open at once; the gate stays open until the stub is idle."""
        if self.stats["active"] >= self.gate:
            self.gate_open.set()
        try:
            await asyncio.wait_for(self.gate_open.wait(), self.args.gate_timeout_s)
        except TimeoutError:
            self.stats["gate_timeouts"] += 1

    async def _first_event_error(self, send):
        """200, then an OpenAI error event as the very first thing (an engine failing at once)."""
        self.stats["aborted"] += 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        event = {"error": {"message": "stub told to fail its first event", "type": "InternalServerError",
                           "param": None, "code": 500}}
        await send({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(event) +
                    b"\n\ndata: [DONE]\n\n", "more_body": False})

    async def _stream(self, receive, send, chat: bool, rid: str, n: int, prompt_ids: list[int] | None = None):
        self.stats["active"] += 1
        self.stats["peak_active"] = max(self.stats["peak_active"], self.stats["active"])
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        gone = asyncio.Event()

        async def watch():  # the ASGI way to learn that the client hung up
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(n):
                if self.args.token_delay_ms:
                    await asyncio.sleep(self.args.token_delay_ms / 1000)
                if gone.is_set():
                    raise ConnectionAbortedError("client disconnected")
                choice = ({"index": 0, "delta": {"content": "tok "}, "finish_reason": None} if chat
                          else {"index": 0, "text": "tok ", "finish_reason": None})
                if prompt_ids is not None:  # return_token_ids: as vLLM sends them
                    choice["token_ids"] = [(sum(prompt_ids) + i) % 1000]
                    if i == 0:
                        (choice if not chat else {})["prompt_token_ids"] = prompt_ids
                if i == n - 1:
                    choice["finish_reason"] = "length"
                chunk = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": obj, "created": created,
                         "model": self.args.model, "system_fingerprint": f"stub-{self.args.port}",
                         "choices": [choice]}
                if chat and i == 0 and prompt_ids is not None:
                    chunk["prompt_token_ids"] = prompt_ids
                await send({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(chunk) + b"\n\n",
                            "more_body": True})
                if i == 0 and self.gate:
                    await self._pass_gate()
            usage = {"id": f"x-{rid}", "object": obj, "created": created, "model": self.args.model, "choices": [],
                     "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}}
            hold = self.args.hold_after_done_ms
            await send({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(usage) +
                        b"\n\ndata: [DONE]\n\n", "more_body": bool(hold)})
            if hold:  # the response's end comes later than its [DONE]
                await asyncio.sleep(hold / 1000)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            self.stats["completed"] += 1
        except (asyncio.CancelledError, Exception):
            self.stats["aborted"] += 1
        finally:
            watcher.cancel()
            self.stats["active"] -= 1
            if self.stats["active"] == 0:
                self.gate_open.clear()


def _is_token_prompt(prompt) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def _stub_token_ids(body: dict) -> list[int]:
    """The "prompt token ids" of a request: its token-id prompt, else one id per byte of its text."""
    prompt = body.get("prompt")
    if _is_token_prompt(prompt):
        return prompt
    text = prompt if isinstance(prompt, str) else msgspec.json.encode(body.get("messages") or "").decode()
    return list(text.encode()[:64])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("prefill", "decode", "pd", "encoder"), required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="stub-model")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-delay-ms", type=float, default=0.0)
    ap.add_argument("--hold-after-done-ms", type=float, default=0.0, help="end a stream this long after its [DONE]")
    ap.add_argument("--require-kv", action="store_true", help="decode: refuse requests that skipped P")
    ap.add_argument("--gate-timeout-s", type=float, default=30.0, help="longest wait at the gate (POST /stub/reset)")
    ap.add_argument("--metaserver-url", default="", help="register and heartbeat like an engine role")
    ap.add_argument("--cluster-token", default="")
    ap.add_argument("--registry-endpoints", default="", help="register in etcd (comma-separated client URLs)")
    ap.add_argument("--registry-cluster", default="default")
    ap.add_argument("--lease-ttl", type=int, default=3, help="etcd lease TTL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--kv-connector", default="", help="speak this KV connector's flow and say so at /kv_info")
    ap.add_argument("--kv-connectors", default="", help="multi: its connectors, comma-separated")
    ap.add_argument("--fail-status", type=int, default=0, help="answer every generation request with this status")
    ap.add_argument("--first-event-error", action="store_true", help="answer every stream with an error event first")
    args = ap.parse_args()
    from ascendserve.config import ServerConfig
    from ascendserve.web.limits import raise_open_files_limit
    from ascendserve.web.server import run

    raise_open_files_limit()  # a load test holds thousands of streams on one stub
    if args.metaserver_url or args.registry_endpoints:
        from ascendserve.discovery import etcd
        from ascendserve.discovery.heartbeat import EtcdRegistrar, Heartbeat, MetaserverRegistrar

        url = f"http://{args.host}:{args.port}"
        registrar = EtcdRegistrar(etcd.EtcdSettings(tuple(args.registry_endpoints.split(",")), args.registry_cluster,
                                                    args.lease_ttl)) if args.registry_endpoints else \
            MetaserverRegistrar(args.metaserver_url, args.cluster_token)
        Heartbeat(registrar, f"stub-{args.role}-{args.port}", args.role, url, url, args.model, interval_s=0.5).start()
    # vLLM's admin routes behind the same guard as a real engine's (engine/middleware); the test's
    # own /stub/ routes stay open
    from ascendserve.engine.middleware import ClusterGuard

    app = Stub(args)
    guarded = ClusterGuard(app, token=args.cluster_token, host=args.host)

    async def serve(scope, receive, send):
        target = app if scope.get("path", "").startswith("/stub/") else guarded
        return await target(scope, receive, send)

    run(serve, ServerConfig(host=args.host, port=args.port))


if __name__ == "__main__":
    main()
