"""bench/chaos.py's load: clients that send one request after another and judge each answer."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import threading
import time
from dataclasses import dataclass

import httpx

from bench._chaos_cluster import Settings

WORDS = "the of a river mountain light signal engine cache block token stream model picture colour".split()


@dataclass
class Record:
    rid: str
    kind: str
    start: float
    end: float = 0.0
    outcome: str = ""  # ok | explicit | other | hung
    detail: str = ""
    path: str = ""
    body: dict | None = None
    ids: list | None = None  # the answer's token ids (every request asks for them)


def png(rng: random.Random) -> str:
    import numpy as np
    from PIL import Image

    w, h = rng.randrange(56, 168, 4), rng.randrange(56, 168, 4)
    pixels = (np.random.default_rng(rng.randrange(1 << 30)).random((h, w, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Load:
    """`concurrency` clients on a thread of their own until stop()."""

    KINDS = ("text-stream", "chat-stream", "image-stream", "image")

    def __init__(self, url: str, model: str, s: Settings):
        self.url, self.model, self.s = url, model, s
        self.records: list[Record] = []
        self.rng = random.Random(s.seed)
        self.images = [png(self.rng) for _ in range(8)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="chaos-load", daemon=True)
        self._n = 0

    def start(self) -> "Load":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.s.deadline_s + 30)
        assert not self._thread.is_alive(), "the load did not stop past its own deadline"

    async def _main(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as c:
            await asyncio.gather(*(self._client(c) for _ in range(self.s.concurrency)))

    def _body(self, kind: str) -> tuple[str, dict]:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randrange(8, 120)))
        common = {"model": self.model, "max_tokens": self.s.max_tokens, "ignore_eos": True, "temperature": 0,
                  "return_token_ids": True}
        if kind.endswith("stream"):
            common |= {"stream": True, "stream_options": {"include_usage": True}}
        if kind == "text-stream":
            return "/v1/completions", dict(common, prompt=words)
        content: list = [{"type": "text", "text": words}]
        if kind.startswith("image"):
            url = self.rng.choice(self.images) if self.rng.random() < 0.5 else png(self.rng)
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        return "/v1/chat/completions", dict(common, messages=[{"role": "user", "content": content}])

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            self._n += 1
            kind = self.rng.choice(self.KINDS)
            path, body = self._body(kind)
            rec = Record(f"chaos-{self.s.seed}-{self._n}", kind, time.monotonic(), path=path, body=body)
            self.records.append(rec)
            try:
                rec.outcome, rec.detail, rec.ids = await asyncio.wait_for(
                    self._one(client, path, body, rec.rid, body.get("stream", False)), self.s.deadline_s)
            except asyncio.TimeoutError:
                rec.outcome, rec.detail = "hung", f"no answer within {self.s.deadline_s:.0f} s"
            except httpx.HTTPError as exc:
                rec.outcome, rec.detail = "other", f"connection: {exc!r}"
            rec.end = time.monotonic()

    async def _one(self, client, path: str, body: dict, rid: str, stream: bool) -> tuple[str, str, list | None]:
        headers = {"x-request-id": rid}
        want = self.s.max_tokens
        if not stream:
            r = await client.post(self.url + path, json=body, headers=headers)
            return judge_json(r.status_code, r.content, want)
        async with client.stream("POST", self.url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                return judge_json(r.status_code, await r.aread(), want)
            raw = b"".join([chunk async for chunk in r.aiter_bytes()])
            return judge_stream(sse_data(raw), want)


def judge_json(status: int, raw: bytes, want: int) -> tuple[str, str, list | None]:
    try:
        body = json.loads(raw)
    except ValueError:
        return "other", f"{status} with a body that is not JSON: {raw[:120]!r}", None
    if status >= 400:
        if isinstance(body, dict) and isinstance(body.get("error"), dict) and body["error"].get("message"):
            return "explicit", f"{status}: {body['error']['message'][:160]}", None
        return "other", f"{status} without an OpenAI error body: {raw[:160]!r}", None
    got = (body.get("usage") or {}).get("completion_tokens") if isinstance(body, dict) else None
    if status == 200 and got == want:
        return "ok", "", (body.get("choices") or [{}])[0].get("token_ids")
    return "other", f"{status} with {got} of {want} tokens", None


def sse_data(raw: bytes) -> list[str]:
    """The `data:` fields of an SSE body. Lines end at CR, LF or CRLF only (the SSE spec):
    not str.splitlines(), which also splits at U+2028 and friends, raw in vLLM's JSON."""
    lines = raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return [line[6:].decode(errors="replace") for line in lines if line.startswith(b"data: ")]


def judge_stream(events: list[str], want: int) -> tuple[str, str, list | None]:
    tokens, ids = None, []
    for data in events:
        if data == "[DONE]":
            continue
        try:
            event = json.loads(data)
        except ValueError:
            return "other", f"an SSE event that is not JSON: {data[:300]!r}", None
        if isinstance(event, dict) and "error" in event:
            return "explicit", f"SSE error event: {str(event['error'])[:160]}", None
        if isinstance(event, dict) and event.get("usage"):
            tokens = event["usage"].get("completion_tokens")
        for choice in (event.get("choices") or ()) if isinstance(event, dict) else ():
            ids += choice.get("token_ids") or []
    if not events or events[-1] != "[DONE]":
        return "other", f"stream truncated after {len(events)} events, no [DONE]", None
    if tokens != want:
        return "other", f"stream ended with {tokens} of {want} tokens", None
    return "ok", "", ids


