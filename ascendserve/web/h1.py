"""A small HTTP/1.1 client for the proxy's hops to engines: POST a JSON body, read the answer whole
or as it streams. Pooled keep-alive connections per host, llhttp (httptools) parsing the answers.

Why not aiohttp here: per request, aiohttp's client was a third of the proxy's CPU on the hot path
(bench/proxy_profile.py: request building, payload registry, timers, tracing hooks, the connector),
for two POSTs whose bodies the proxy already holds as bytes and whose answers it only forwards or
decodes once. This does the same work with one write per request and one parser per connection.
aiohttp stays for everything else (health checks, admin calls, etcd, the metaserver).

Semantics kept from the aiohttp session it replaces (web/upstream.py):
- a whole-exchange deadline (`request_timeout_s`): past it the connection is closed and a read
  raises `UpstreamTimeout`; a connect deadline (`connect_timeout_s`);
- idle connections are closed after `keepalive_s` and never reused past it (under vLLM's own
  5 s keep-alive, so a POST never goes out on a socket the engine is closing);
- `Response.close()` before the end of the answer closes the connection, which aborts the
  request on the engine; a fully read answer returns its connection to the pool;
- no Accept-Encoding is sent, so engines answer uncompressed; answers are not decompressed;
- a host name's addresses are looked up once per `DNS_TTL_S` (aiohttp's default TTL), not on every
  new connection, and looked up again at once when a connection to them fails (a pod moved).
Errors are ConnectionError subclasses (what the callers already catch for aiohttp's).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl as ssl_module
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

KEEPALIVE_S = 4.0
DNS_TTL_S = 10.0
PAUSE_AT = 4 << 20  # unread answer bytes held before the socket's reading pauses
_URL_CACHE_MAX = 4096


class UpstreamConnectionError(ConnectionError):
    """The connection failed or closed before the answer was whole."""


class UpstreamTimeout(UpstreamConnectionError):
    """The exchange passed its deadline (connect or whole request)."""


class Response:
    """One answer: `status` once its head arrived, the body through `read()`, `readany()` or
    `iter_any()` (also as `.content`, the shape of aiohttp's response the callers use)."""

    __slots__ = ("status", "_conn", "_chunks", "_held", "_waiter", "_error", "_done", "_head", "_timer",
                 "_keep", "_eof_ends")

    def __init__(self, conn: _Conn):
        self.status = 0
        self._conn: _Conn | None = conn
        self._chunks: deque[bytes] = deque()
        self._held = 0
        self._waiter: asyncio.Future | None = None
        self._error: BaseException | None = None
        self._done = False
        self._head: asyncio.Future = conn.loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self._keep = False
        self._eof_ends = False  # neither a length nor chunked: the body ends with the connection

    @property
    def content(self) -> Response:
        return self

    # --- what the parser and the connection tell it
    def _headers(self, status: int, keep: bool, eof_ends: bool) -> None:
        self.status, self._keep, self._eof_ends = status, keep, eof_ends
        if not self._head.done():
            self._head.set_result(None)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._held += len(data)
        if self._held > PAUSE_AT and self._conn is not None:
            self._conn.pause()
        self._wake()

    def _complete(self) -> None:
        self._done = True
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finished(self._keep)
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._done or self._error is not None:
            return
        self._error = exc
        self._stop_timer()
        self._conn = None
        if not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()  # retrieved: a caller that gave up must not see it logged
        self._wake()

    def _lost(self, exc: BaseException | None) -> None:
        if self._eof_ends and self._head.done() and self._error is None:
            self._keep = False
            self._complete()
            return
        self._fail(UpstreamConnectionError(f"connection closed before the answer was whole: {exc!r}"
                                           if exc else "connection closed before the answer was whole"))

    def _expired(self) -> None:
        self._timer = None
        conn = self._conn
        self._fail(UpstreamTimeout("the request's deadline passed"))
        if conn is not None:
            conn.close()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # --- a watchdog's side (router/migrate.py: one a stream, where a timed read each cost more)
    @property
    def ended(self) -> bool:
        """Read to its end, failed or closed: no read of it will wait any more."""
        return self._conn is None

    @property
    def waiting(self) -> bool:
        """A read is waiting for the next bytes."""
        return self._waiter is not None and not self._waiter.done()

    def interrupt(self, exc: BaseException) -> None:
        """The waiting read raises `exc` (the response stays as it is: its caller closes it)."""
        if self.waiting:
            self._waiter.set_exception(exc)

    # --- the caller's side
    async def readany(self, timeout: float | None = None) -> bytes:
        """What has come of the body since the last read (at least one byte); b"" at its end.
        `timeout`: raise TimeoutError when nothing came within it (the connection stays; a timer
        handle, where asyncio.timeout costs 7 us a read)."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            loop = self._conn.loop
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(timeout, _time_out, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._held > PAUSE_AT and self._conn is not None:
            self._conn.resume()
        self._held = 0
        return data

    async def iter_any(self):
        while chunk := await self.readany():
            yield chunk

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """An answer not read to its end closes its connection (the engine aborts the request)."""
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is not None and not self._done:
            if self._error is None:
                self._error = UpstreamConnectionError("the answer was closed")
            conn.close()
        self._wake()



def _time_out(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Conn(asyncio.Protocol):
    """One keep-alive connection: one request at a time, its answer parsed by llhttp."""

    def __init__(self, pool: Client, key: tuple, loop: asyncio.AbstractEventLoop):
        self.pool, self.key, self.loop = pool, key, loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self._length = False  # the current answer's framing, from its headers
        self._paused = False

    # --- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing asked: an idle connection's engine said something
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            response = self.response
            self.close()
            if response is not None:
                response._fail(UpstreamConnectionError(f"malformed HTTP answer: {exc}"))

    def eof_received(self):
        return False  # close our side too

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        response, self.response = self.response, None
        if response is not None:
            response._lost(exc)

    # --- llhttp callbacks
    def on_message_begin(self) -> None:
        self._length = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) in (14, 17):
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                self._length = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if self.response is not None:
            if 100 <= status < 200:
                return  # an interim answer (we never send Expect): the real one follows
            self.response._headers(status, self.parser.should_keep_alive(), not self._length)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._body(body)

    def on_message_complete(self) -> None:
        if 100 <= self.parser.get_status_code() < 200:
            return
        response, self.response = self.response, None
        if response is not None:
            response._complete()

    # --- ours
    def send(self, data: bytes, response: Response) -> None:
        self.response = response
        self.transport.write(data)

    def finished(self, keep: bool) -> None:
        if self._paused:
            self.resume()
        if keep and not self.closed:
            self.pool._park(self)
        else:
            self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()


async def _open_socket(infos: list, loop) -> socket.socket:
    """A socket connected to the first of getaddrinfo's addresses that takes the connection."""
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            return sock
        except BaseException as exc:  # a deadline's cancellation too: no socket is left open
            sock.close()
            if not isinstance(exc, OSError):
                raise
            error = exc
    raise error or OSError("no address")


class Client:
    """Keep-alive connections per (scheme, host, port); `post()` sends one request on one of them."""

    def __init__(self, request_timeout_s: float, connect_timeout_s: float = 5.0,
                 ssl_context: ssl_module.SSLContext | None = None, keepalive_s: float = KEEPALIVE_S):
        self.request_timeout_s, self.connect_timeout_s = request_timeout_s, connect_timeout_s
        self.keepalive_s = keepalive_s
        self._ssl = ssl_context
        self._idle: dict[tuple, list[_Conn]] = {}
        self._all: set[_Conn] = set()
        self._urls: dict[str, tuple[tuple, bytes, str]] = {}
        self._dns: dict[tuple[str, int], tuple[float, list]] = {}  # (host, port) -> (until, getaddrinfo's answer)
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    def _split(self, url: str) -> tuple[tuple, bytes, str]:
        """(pool key, the request line's start and Host header, the host for TLS), cached per URL."""
        hit = self._urls.get(url)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamConnectionError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        default = (tls and port == 443) or (not tls and port == 80)
        head = f"POST {target} HTTP/1.1\r\nhost: {host if default else f'{host}:{port}'}\r\n".encode("ascii")
        if len(self._urls) >= _URL_CACHE_MAX:
            self._urls.clear()
        hit = self._urls[url] = ((tls, parts.hostname, port), head, parts.hostname)
        return hit

    async def _connect(self, key: tuple, server_hostname: str, loop) -> _Conn:
        tls, host, port = key
        context = None
        if tls:
            context = self._ssl if self._ssl is not None else ssl_module.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                sock = await _open_socket(await self._addresses(host, port, loop), loop)
                _, conn = await loop.create_connection(lambda: _Conn(self, key, loop), sock=sock, ssl=context,
                                                       server_hostname=server_hostname if tls else None)
        except TimeoutError:
            self._dns.pop((host, port), None)
            raise UpstreamTimeout(f"connect to {host}:{port}: no connection in {self.connect_timeout_s:g} s") from None
        except ssl_module.SSLError as exc:
            raise UpstreamConnectionError(f"TLS to {host}:{port}: {exc}") from None
        except OSError as exc:
            self._dns.pop((host, port), None)  # looked up again on the next try
            raise UpstreamConnectionError(f"connect to {host}:{port}: {exc}") from None
        self._all.add(conn)
        return conn

    async def _addresses(self, host: str, port: int, loop) -> list:
        """getaddrinfo's answer for host:port, kept `DNS_TTL_S` (an IP address is not looked up)."""
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]
        now = time.monotonic()
        hit = self._dns.get((host, port))
        if hit is not None and hit[0] > now:
            return hit[1]
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"no address for {host}")
        if len(self._dns) >= _URL_CACHE_MAX:
            self._dns.clear()
        self._dns[(host, port)] = (now + DNS_TTL_S, infos)
        return infos

    def _take(self, key: tuple) -> _Conn | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.close()
        return None

    def _park(self, conn: _Conn) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweep is None:
            self._sweep = conn.loop.call_later(self.keepalive_s, self._sweep_idle)

    def _forget(self, conn: _Conn) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def _sweep_idle(self) -> None:
        """Close what has been idle for `keepalive_s` (sockets of a burst go back soon)."""
        self._sweep = None
        now, left = time.monotonic(), False
        for key, idle in list(self._idle.items()):
            for conn in [c for c in idle if now - c.idle_since >= self.keepalive_s]:
                conn.close()
            if idle:
                left = True
            else:
                del self._idle[key]
        if left and not self._closed:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s / 2, self._sweep_idle)

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Response:
        """Send `body` (JSON) to `url`; returns once the answer's status is known. The caller reads
        the body and closes the response (or reads it to its end, which releases the connection)."""
        if self._closed:
            raise UpstreamConnectionError("the client is closed")
        key, head, server_hostname = self._split(url)
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            raise ValueError("a header name or value holds CR or LF")
        data = b"".join((head, lines.encode("latin-1"), b"content-length: %d\r\n\r\n" % len(body), body))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        conn = self._take(key)
        if conn is None:
            conn = await self._connect(key, server_hostname, loop)
        response = Response(conn)
        response._timer = loop.call_at(deadline, response._expired)
        conn.send(data, response)
        try:
            await response._head
        except BaseException:
            response.close()
            raise
        return response

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
