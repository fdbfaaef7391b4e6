"""HTTP to engine instances, pooled per proxy process: the hot path's POSTs (a JSON answer, or a stream)
through web/h1's client, everything else (health checks, admin calls) through an aiohttp session."""

from __future__ import annotations

import ssl

import aiohttp
import msgspec

from ascendserve.protocol.wire import decode_json
from ascendserve.web import h1

# Idle pooled connections are dropped (and never reused) after this long: under
# vLLM's own keep-alive (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), so a POST never goes
# out on a socket the engine is closing, and a burst's sockets are returned soon.
KEEPALIVE_S = h1.KEEPALIVE_S


def engine_headers(cluster_token: str, backend_api_key: str = "") -> dict[str, str]:
    """What every request to an engine carries: the cluster token, which an engine wants on its
    admin routes and, bound off loopback, on its client API too (engine/middleware.ClusterGuard),
    and the backend API key (vLLM's own --api-key) as Authorization."""
    headers = {"x-cluster-token": cluster_token} if cluster_token else {}
    if backend_api_key:
        headers["authorization"] = f"Bearer {backend_api_key}"
    return headers


class UpstreamError(Exception):
    """A backend hop failed. `status` is None when no HTTP answer came back."""

    def __init__(self, url: str, status: int | None, detail: str, body: bytes = b""):
        super().__init__(f"{url}: {status or 'no response'}: {detail}")
        self.url, self.status, self.detail, self.body = url, status, detail, body

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status >= 500

    @property
    def client_error(self) -> bool:
        return self.status is not None and 400 <= self.status < 500


class Upstream:
    def __init__(self, request_timeout_s: float, connect_timeout_s: float = 5.0, headers: dict | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._headers = headers or {}
        self._ssl = ssl_context if ssl_context is not None else True  # https: cluster.tls_ca, else system CAs
        self._session: aiohttp.ClientSession | None = None
        self._h1 = h1.Client(request_timeout_s, connect_timeout_s, ssl_context, KEEPALIVE_S)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=KEEPALIVE_S,
                                        ssl=self._ssl)
        self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                              json_serialize=lambda o: msgspec.json.encode(o).decode(),
                                              auto_decompress=False)

    async def close(self) -> None:
        await self._h1.close()
        if self._session is not None:
            await self._session.close()

    def _h(self, headers: dict | None) -> dict:
        return {**self._headers, "content-type": "application/json", **(headers or {})}

    async def post_json(self, url: str, body: dict, headers: dict | None = None) -> dict:
        try:
            r = await self._h1.post(url, msgspec.json.encode(body), self._h(headers))
            try:
                raw = await r.read()
            finally:
                r.close()
        except (TimeoutError, ConnectionError) as exc:
            raise UpstreamError(url, None, repr(exc)) from None
        if r.status >= 300:
            raise UpstreamError(url, r.status, raw[:500].decode(errors="replace"), raw)
        try:
            return decode_json(raw)
        except msgspec.DecodeError:
            raise UpstreamError(url, 502, "backend answered with invalid JSON", raw) from None

    async def open_stream(self, url: str, body: dict, headers: dict | None = None) -> h1.Response:
        """POST and return the response once its status is known to be 2xx. The caller owns the
        response: it reads it to its end or `close()`s it (which aborts the request on the engine)."""
        try:
            r = await self._h1.post(url, msgspec.json.encode(body), self._h(headers))
        except (TimeoutError, ConnectionError) as exc:
            raise UpstreamError(url, None, repr(exc)) from None
        if r.status >= 300:
            try:
                raw = await r.read()
            except (TimeoutError, ConnectionError):
                raw = b""
            finally:
                r.close()
            raise UpstreamError(url, r.status, raw[:500].decode(errors="replace"), raw)
        return r

    async def get(self, url: str, timeout_s: float, headers: dict | None = None) -> tuple[int, bytes]:
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                         headers={**self._headers, **(headers or {})}) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise UpstreamError(url, None, repr(exc)) from None

    async def post(self, url: str, timeout_s: float, body: dict | None = None,
                   headers: dict | None = None) -> tuple[int, bytes]:
        try:
            async with self._session.post(url, data=msgspec.json.encode(body or {}), headers=self._h(headers),
                                          timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            raise UpstreamError(url, None, repr(exc)) from None
