"""web/h1: the proxy's HTTP/1.1 client to engines, against raw asyncio servers on 127.0.0.1 that
answer byte for byte as told (lengths, chunks, streams held open, early closes, silence)."""

from __future__ import annotations

import asyncio
import functools
import ssl
import time

import pytest

from ascendserve.web import h1
from ascendserve.web.upstream import Upstream, UpstreamError
from tests.tlstools import write_self_signed


class Server:
    """Accepts connections; `answer(reader, writer, request_head, body)` answers each request on a
    connection, one after another, until it returns False or the client closes."""

    def __init__(self, answer, ssl_context=None):
        self.answer, self.ssl = answer, ssl_context
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []
        self.closed_by_client = asyncio.Event()
        self.server = None

    async def __aenter__(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl)
        self.port = self.server.sockets[0].getsockname()[1]
        scheme = "https" if self.ssl else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        return self

    async def __aexit__(self, *exc):
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client.set()
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                self.requests.append((head, body))
                if await self.answer(reader, writer, head, body) is False:
                    return
        finally:
            try:
                writer.close()
            except Exception:
                pass


async def json_ok(reader, writer, head, body):
    payload = b'{"echo": %d}' % len(body)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(payload), payload))
    await writer.drain()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def run(fn):
    @functools.wraps(fn)
    def sync(*args, **kwargs):
        return asyncio.run(asyncio.wait_for(fn(*args, **kwargs), 30))
    return sync


def client(**kw) -> h1.Client:
    return h1.Client(kw.pop("request_timeout_s", 10.0), kw.pop("connect_timeout_s", 2.0), **kw)


@run
async def test_json_answers_reuse_one_connection_and_the_request_is_what_was_asked():
    async with Server(json_ok) as srv:
        c = client()
        for n in range(3):
            r = await c.post(srv.url + "/v1/completions?x=1", b'{"a": %d}' % n, {"content-type": "application/json",
                                                                                 "x-request-id": "r1"})
            assert r.status == 200
            assert await r.read() == b'{"echo": 8}'
            r.close()  # after a whole answer: a no-op, the connection is back in the pool
        assert srv.connections == 1
        head, body = srv.requests[0]
        lines = head.decode().split("\r\n")
        assert lines[0] == "POST /v1/completions?x=1 HTTP/1.1"
        fields = dict(line.split(": ", 1) for line in lines[1:] if line)
        assert fields == {"host": f"127.0.0.1:{srv.port}", "content-type": "application/json",
                          "x-request-id": "r1", "content-length": "8"}
        assert body == b'{"a": 0}'
        await c.close()


@run
async def test_a_host_name_is_looked_up_once_per_ttl_and_again_after_a_failed_connect():
    loop = asyncio.get_running_loop()
    lookups, real = [], loop.getaddrinfo

    async def counted(host, *args, **kwargs):
        lookups.append(host)
        return await real(host, *args, **kwargs)

    loop.getaddrinfo = counted
    c = client(keepalive_s=0.0)  # no connection is reused: each request connects
    async with Server(json_ok) as srv:
        r = await c.post(srv.url + "/x", b"{}", {})  # an IP address: nothing to look up
        assert await r.read() == b'{"echo": 2}' and lookups == []
        url = f"http://localhost:{srv.port}/x"  # ::1 first, where the host has it: refused, then 127.0.0.1
        for _ in range(3):
            r = await c.post(url, b"{}", {})
            assert await r.read() == b'{"echo": 2}'
        assert srv.connections == 4 and lookups == ["localhost"]
    for n in (1, 2):  # the engine is gone (a pod that moved): a failed connect forgets the addresses
        with pytest.raises(h1.UpstreamConnectionError, match="connect to localhost"):
            await c.post(url, b"{}", {})
        assert lookups == ["localhost"] * n
    await c.close()


@run
async def test_a_stream_arrives_as_it_is_sent_and_its_end_releases_the_connection():
    go = asyncio.Event()

    async def stream(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        writer.write(chunk(b"data: 1\n\n"))
        await writer.drain()
        await go.wait()
        writer.write(chunk(b"data: 2\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with Server(stream) as srv:
        c = client()
        r = await c.post(srv.url + "/s", b"{}", {})
        assert r.status == 200
        assert await r.content.readany() == b"data: 1\n\n"  # before the rest exists
        go.set()
        rest = [x async for x in r.content.iter_any()]
        assert b"".join(rest) == b"data: 2\n\ndata: [DONE]\n\n"
        go.clear()
        r2 = await c.post(srv.url + "/s", b"{}", {})
        assert await r2.content.readany() == b"data: 1\n\n"
        assert srv.connections == 1, "a stream read to its end gives its connection back"
        r2.close()
        await c.close()


@run
async def test_a_timed_read_gives_up_and_the_stream_goes_on():
    go = asyncio.Event()

    async def slow(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await go.wait()
        writer.write(chunk(b"data: late\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with Server(slow) as srv:
        c = client()
        r = await c.post(srv.url + "/s", b"{}", {})
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await r.readany(0.2)
        assert 0.15 < time.monotonic() - started < 2
        go.set()
        assert await r.readany(5) == b"data: late\n\n"
        assert await r.readany(5) == b""
        await c.close()


@run
async def test_closing_a_stream_early_closes_its_connection():
    gone = asyncio.Event()

    async def hold(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # until the client goes
        gone.set()
        return False

    async with Server(hold) as srv:
        c = client()
        r = await c.post(srv.url + "/s", b"{}", {})
        assert await r.readany() == b"data: 1\n\n"
        r.close()
        await asyncio.wait_for(gone.wait(), 5)
        with pytest.raises(h1.UpstreamConnectionError):
            await r.readany()
        r2 = await c.post(srv.url + "/s", b"{}", {})
        assert srv.connections == 2, "a stream closed early is never reused"
        r2.close()
        await c.close()


@run
async def test_the_request_deadline_closes_a_silent_exchange():
    gone = asyncio.Event()

    async def silent(reader, writer, head, body):
        await reader.read()  # until the client goes
        gone.set()
        return False

    async with Server(silent) as srv:
        c = client(request_timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(h1.UpstreamTimeout):
            await c.post(srv.url + "/x", b"{}", {})
        assert time.monotonic() - started < 2
        await asyncio.wait_for(gone.wait(), 5)
        await c.close()


@run
async def test_the_deadline_also_ends_a_stream_that_stops():
    async def stalls(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()
        return False

    async with Server(stalls) as srv:
        c = client(request_timeout_s=0.4)
        r = await c.post(srv.url + "/s", b"{}", {})
        assert await r.readany() == b"data: 1\n\n"
        with pytest.raises(h1.UpstreamTimeout):
            await r.readany()
        await c.close()


@run
async def test_idle_connections_close_after_the_keepalive_and_are_not_reused():
    async with Server(json_ok) as srv:
        c = client(keepalive_s=0.3)
        await (await c.post(srv.url + "/a", b"{}", {})).read()
        await asyncio.wait_for(srv.closed_by_client.wait(), 5)  # the sweep closed it
        await (await c.post(srv.url + "/a", b"{}", {})).read()
        assert srv.connections == 2
        await c.close()


@run
async def test_a_connection_lost_mid_body_is_an_error_not_a_short_answer():
    async def dies(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
        await writer.drain()
        return False

    async with Server(dies) as srv:
        c = client()
        r = await c.post(srv.url + "/a", b"{}", {})
        with pytest.raises(h1.UpstreamConnectionError, match="before the answer was whole"):
            await r.read()
        await c.close()


@run
async def test_an_answer_without_length_ends_with_the_connection():
    async def until_eof(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"whole" * 3)
        await writer.drain()
        return False

    async with Server(until_eof) as srv:
        c = client()
        r = await c.post(srv.url + "/a", b"{}", {})
        assert await r.read() == b"wholewholewhole"
        await c.close()


@run
async def test_error_statuses_refused_connections_malformed_answers_and_header_injection():
    async def teapot(reader, writer, head, body):
        writer.write(b"HTTP/1.1 418 I'm a teapot\r\ncontent-length: 5\r\n\r\nshort")
        await writer.drain()

    async def garbage(reader, writer, head, body):
        writer.write(b"SMTP ready\r\n\r\n")
        await writer.drain()
        await reader.read()
        return False

    async with Server(teapot) as srv:
        c = client()
        r = await c.post(srv.url + "/a", b"{}", {})
        assert (r.status, await r.read()) == (418, b"short")
        with pytest.raises(ValueError, match="CR or LF"):
            await c.post(srv.url + "/a", b"{}", {"x-request-id": "a\r\nx-admin: 1"})
        await c.close()
    async with Server(garbage) as srv:
        c = client()
        with pytest.raises(h1.UpstreamConnectionError, match="malformed"):
            await c.post(srv.url + "/a", b"{}", {})
        await c.close()
    with pytest.raises(h1.UpstreamConnectionError, match="connect to 127.0.0.1"):
        await client().post(f"http://127.0.0.1:{srv.port}/gone", b"{}", {})


@run
async def test_a_large_answer_read_slowly_is_whole():
    big = bytes(range(256)) * (48 * 1024)  # 12 MiB: past the point where reading pauses

    async def large(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
        for i in range(0, len(big), 1 << 20):
            writer.write(big[i:i + (1 << 20)])
            await writer.drain()

    async with Server(large) as srv:
        c = client()
        r = await c.post(srv.url + "/a", b"{}", {})
        await asyncio.sleep(0.5)  # let it pile up unread
        assert await r.read() == big
        await (await c.post(srv.url + "/a", b"{}", {})).read()
        assert srv.connections == 1
        await c.close()


@run
async def test_tls_with_the_cluster_ca(tmp_path):
    cert, key = write_self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    async with Server(json_ok, server_ctx) as srv:
        trusted = ssl.create_default_context(cafile=str(cert))
        c = client(ssl_context=trusted)
        r = await c.post(srv.url + "/a", b"{}", {})
        assert await r.read() == b'{"echo": 2}'
        await c.close()
        with pytest.raises(h1.UpstreamConnectionError, match="TLS"):
            await client().post(srv.url + "/a", b"{}", {})  # system CAs: not trusted


@run
async def test_upstream_maps_failures_to_upstream_errors():
    async def answers(reader, writer, head, body):
        if b"/bad" in head:
            payload = b"not json"
        elif b"/500" in head:
            writer.write(b"HTTP/1.1 500 Internal\r\ncontent-length: 4\r\n\r\noops")
            await writer.drain()
            return
        else:
            payload = b'{"ok": true}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()

    async with Server(answers) as srv:
        up = Upstream(5.0, 1.0, {"x-cluster-token": "t"})
        await up.start()
        assert await up.post_json(srv.url + "/ok", {"a": 1}) == {"ok": True}
        assert b"x-cluster-token: t" in srv.requests[-1][0]
        with pytest.raises(UpstreamError) as bad:
            await up.post_json(srv.url + "/bad", {})
        assert bad.value.status == 502
        with pytest.raises(UpstreamError) as failed:
            await up.open_stream(srv.url + "/500", {})
        assert (failed.value.status, failed.value.body, failed.value.retryable) == (500, b"oops", True)
        port = srv.port
        await up.close()
    up = Upstream(5.0, 1.0)
    await up.start()
    with pytest.raises(UpstreamError) as gone:
        await up.post_json(f"http://127.0.0.1:{port}/ok", {})
    assert gone.value.status is None and gone.value.retryable
    await up.close()


@run
async def test_a_leg_s_watchdog_gives_up_a_silent_engine_and_only_a_silent_one():
    """router/migrate.Leg's reads are untimed; its one watchdog interrupts a read waiting past the
    stall deadline (with another instance to go to), or silent for a second on an instance its
    health checks ejected. A slow engine with no other, and a leg its client is not reading, go on."""
    from ascendserve.router.ledger import BackendFailed
    from ascendserve.router.migrate import Leg
    from ascendserve.router.pools import EJECTED, Pool
    from ascendserve.router.sse import SSEFramer

    gaps: list[float] = []  # the server's silence before each event, in turn

    async def events(reader, writer, head, body):
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for n, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            writer.write(chunk(b'data: {"n": %d}\n\n' % n))
            await writer.drain()
        await reader.read()  # then silence, until the client closes

    async with Server(events) as srv:
        c = client()
        pool = Pool("decode")
        inst = pool.add(srv.url)

        async def leg() -> Leg:
            return Leg(pool.lease(inst, 1), await c.post(srv.url + "/s", b"{}", {}), SSEFramer())

        # a stall: given up at the deadline, not before
        gaps[:] = [0.0]
        first = await leg()
        assert (await first.next_events(0.5))[0] == [b'{"n": 0}']
        started = time.monotonic()
        with pytest.raises(BackendFailed) as failed:
            await first.next_events(0.5)
        assert failed.value.reason == "stall" and 0.45 < time.monotonic() - started < 1.5
        first.close(ok=False)
        assert first._watch is None

        # slower than the deadline, but no other instance to go to: it waits; so does a leg whose
        # client is not reading (its next event came while nobody waited for it)
        gaps[:] = [0.0, 1.2, 0.3]
        slow = await leg()
        assert (await slow.next_events(0.5, lambda: False))[0] == [b'{"n": 0}']
        assert (await slow.next_events(0.5, lambda: False))[0] == [b'{"n": 1}']
        await asyncio.sleep(1.0)
        assert (await slow.next_events(0.5))[0] == [b'{"n": 2}']
        slow.close(ok=True)

        # ejected by its health checks while silent: given up after a second, long before the deadline
        gaps[:] = [0.0]
        ejected = await leg()
        assert (await ejected.next_events(30))[0] == [b'{"n": 0}']
        inst.state = EJECTED
        started = time.monotonic()
        with pytest.raises(BackendFailed) as failed:
            await ejected.next_events(30)
        assert failed.value.reason == "ejected" and 0.9 < time.monotonic() - started < 2.5
        ejected.close(ok=False)
        assert inst.active_requests == 0
        await c.close()
