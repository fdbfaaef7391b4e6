"""web/rsgi.py: an ASGI app served by web/server over granian's RSGI interface, as every role's
server is. A real server process on 127.0.0.1 runs the small ASGI app below; the client is httpx
or a raw socket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import free_port

REPO = Path(__file__).resolve().parents[2]
KEPT: list = []  # the app keeps every request's receive here: a reference that outlives the request


async def app(scope, receive, send):
    """/echo: the scope and the body as received; /stream: 3 chunks, then more only while
    ?slow; /held: a stream whose exchange stays referenced after it ends."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                scope["state"]["started"] = "yes"
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                Path(os.environ["SHUTDOWN_MARK"]).write_text("shut down")
                await send({"type": "lifespan.shutdown.complete"})
                return
    path = scope["path"]
    if path.startswith("/echo"):
        messages = []
        while True:
            message = await receive()
            messages.append((len(message.get("body", b"")), message.get("more_body", False)))
            if not message.get("more_body", False):
                break
        info = {k: scope[k] for k in ("method", "path", "query_string", "raw_path", "scheme", "http_version",
                                      "client", "server", "state")}
        info = json.loads(json.dumps(info, default=lambda v: v.decode("latin-1")))
        info["headers"] = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]]
        info["messages"] = messages
        payload = json.dumps(info).encode()  # sizes only: the client checks them
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/json"), (b"x-one", b"1")]})
        await send({"type": "http.response.body", "body": payload})
        return
    await receive()
    if path == "/held":
        KEPT.append(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(3):
        await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
    if scope["query_string"] == b"slow":
        gone = asyncio.ensure_future(receive())
        try:
            for i in range(3, 200):
                await asyncio.sleep(0.05)
                await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
        except RuntimeError as exc:  # the client went: the send raises
            await asyncio.wait_for(gone, 5)
            Path(os.environ["SHUTDOWN_MARK"] + ".gone").write_text(f"{gone.result()['type']} {type(exc).__name__}")
            return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def _serve(port: int) -> None:
    from ascendserve.config import ServerConfig
    from ascendserve.web import server

    server.run(app, ServerConfig(port=port))


@pytest.fixture
def served(tmp_path):
    port = free_port()
    mark = tmp_path / "mark"
    code = f"from tests.integration.test_rsgi_adapter import _serve; _serve({port})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "SHUTDOWN_MARK": str(mark),
                                                                          "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(url + "/echo", timeout=1)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the test server did not start")
            time.sleep(0.1)
    yield url, mark, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_scope_body_and_whole_response(served):
    url, _, _ = served
    body = os.urandom(300_000)
    r = httpx.post(url + "/echo/a%20b?x=1%202&y", content=body, headers={"X-Mixed-Case": "Value"}, timeout=10)
    assert r.status_code == 201 and r.headers["x-one"] == "1"
    assert r.headers["content-length"] == str(len(r.content))  # a whole response: no chunked encoding
    info = r.json()
    assert info["method"] == "POST" and info["path"] == "/echo/a b" and info["raw_path"] == "/echo/a%20b"
    assert info["query_string"] == "x=1%202&y" and info["scheme"] == "http" and info["http_version"] == "1.1"
    assert info["client"][0] == "127.0.0.1" and info["server"] == ["127.0.0.1", int(url.rsplit(":", 1)[1])]
    assert info["state"] == {"started": "yes"}  # the lifespan's state, as granian's ASGI gives it
    assert ["x-mixed-case", "Value"] in info["headers"]
    sizes = [size for size, _ in info["messages"]]
    assert sum(sizes) == len(body) and [more for _, more in info["messages"]][-1] is False
    assert all(more for _, more in info["messages"][:-1])
    # no Content-Length: chunked upload, read to its end
    r = httpx.post(url + "/echo", content=iter([body[:1000], body[1000:]]), timeout=10)
    assert sum(size for size, _ in r.json()["messages"]) == len(body)
    # no body at all
    assert httpx.get(url + "/echo").json()["messages"] == [[0, False]]


def test_a_stream_ends_when_the_app_ends_it_even_while_its_exchange_is_referenced(served):
    """granian ends a stream when its transport is released: a reference to the request's receive
    kept after the response (a disconnect listener in a cycle) held the response open until a
    garbage collection, so every client waited (the bug this guards)."""
    url, _, _ = served
    for path in ("/stream", "/held", "/held"):
        started = time.monotonic()
        r = httpx.get(url + path, timeout=5)
        assert r.text == "chunk 0\nchunk 1\nchunk 2\n"
        assert time.monotonic() - started < 2


def test_a_client_that_goes_mid_stream_is_seen(served):
    url, mark, _ = served
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /stream?slow HTTP/1.1\r\nhost: x\r\n\r\n")
        got = b""
        while b"chunk 4" not in got:
            got += sock.recv(4096)
    gone = Path(str(mark) + ".gone")
    deadline = time.monotonic() + 10
    # write_text creates the file before it writes: wait for its words, not for the file
    while not (gone.exists() and gone.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone.read_text() == "http.disconnect RSGIProtocolClosed"


def test_lifespan_shutdown_runs_on_sigterm(served):
    _, mark, proc = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    assert mark.read_text() == "shut down"
