"""A fault injector in front of a real engine: it relays every request to the engine and breaks
the streams it is told to, after a given number of SSE events.

    python -m tests.cutter --port 9100 --backend http://127.0.0.1:8000

POST /cut {"after": K, "how": "reset" | "error" | "stall" | "end" | "first_error", "only_text": true}
sets what happens to each following stream: after K whole events the connection is reset, an
OpenAI error event is sent, the stream goes silent (held open, no byte) or ends without [DONE];
`first_error` answers an error event as the first thing. With only_text (the default) streams
whose prompt is token ids (the proxy's continuations) pass untouched, so two cutters in front of
one engine make every first leg fail and every continuation succeed: the splice is then checked
against the same engine's uninterrupted answer. GET /cut/stats counts the cut streams.
The proxy and the engine are the things under test; this only breaks the wire between them.
"""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
from aiohttp import web


def _is_token_prompt(body: dict) -> bool:
    prompt = body.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and all(type(t) is int for t in prompt)


def build(backend: str) -> web.Application:
    rule = {"after": -1, "how": "reset", "only_text": True}
    stats = {"cut": 0, "passed": 0}
    session: dict = {}

    async def client() -> aiohttp.ClientSession:
        if "s" not in session:
            session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return session["s"]

    async def set_cut(request: web.Request) -> web.Response:
        rule.update(await request.json())
        return web.json_response(rule)

    async def get_stats(request: web.Request) -> web.Response:
        return web.json_response(stats)

    async def relay(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = await request.json() if raw and request.method == "POST" else {}
        s = await client()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "x-request-id",
                                                                              "content-type")}
        cut = body.get("stream") is True and rule["after"] >= 0 and not (rule["only_text"] and _is_token_prompt(body))
        async with s.request(request.method, backend + request.path_qs, data=raw or None, headers=headers) as r:
            if not cut or r.status != 200:
                stats["passed"] += 1
                out = web.StreamResponse(status=r.status, headers={"content-type": r.headers.get("content-type", "")})
                await out.prepare(request)
                async for chunk in r.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
            stats["cut"] += 1
            out = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            if rule["how"] == "first_error":
                await out.write(b'data: {"error": {"message": "injected", "type": "InternalServerError", '
                                b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n')
                await out.write_eof()
                return out
            sent, buf = 0, b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf and sent < rule["after"]:
                    event, buf = buf.split(b"\n\n", 1)
                    await out.write(event + b"\n\n")
                    sent += 1
                if sent >= rule["after"]:
                    break
            how = rule["how"]
            if how == "error":
                await out.write(b'data: {"error": {"message": "injected", "type": "InternalServerError", '
                                b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n')
            elif how == "stall":  # silent, until the proxy gives up on it
                while request.transport is not None and not request.transport.is_closing():
                    await asyncio.sleep(0.2)
                return out
            elif how == "reset":
                request.transport.abort()
                return out
            await out.write_eof()  # "end": no [DONE]
            return out

    app = web.Application()
    app.router.add_post("/cut", set_cut)
    app.router.add_get("/cut/stats", get_stats)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", required=True)
    args = ap.parse_args()
    web.run_app(build(args.backend.rstrip("/")), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
