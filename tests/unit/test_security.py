"""Security settings: TLS files checked at load, no open internal port off loopback,
server limits handed to granian, secrets masked in every rendered log line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascendserve.config import ConfigError, load, redacted
from ascendserve.security import security_warnings
from ascendserve.logging import make_formatter
from ascendserve.web.server import granian_options

REPO = Path(__file__).resolve().parents[2]


def self_signed(directory: Path, name: str = "server") -> tuple[Path, Path]:
    from tests.tlstools import write_self_signed

    return write_self_signed(directory, name)


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def test_tls_files_are_checked_at_load(tmp_path):
    cert, key = self_signed(tmp_path)
    c = load("metaserver", None, {"server__tls_cert": str(cert), "server__tls_key": str(key)}, env={})
    assert c.local_url.startswith("https://") and c.scheme == "https"
    other_cert, other_key = self_signed(tmp_path, "other")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    cases = [
        ({"server__tls_cert": str(cert)}, "go together"),
        ({"server__tls_cert": str(tmp_path / "absent.pem"), "server__tls_key": str(key)}, "does not exist"),
        ({"server__tls_cert": str(tmp_path), "server__tls_key": str(key)}, "not a file"),
        ({"server__tls_cert": str(garbage), "server__tls_key": str(key)}, "not a PEM certificate chain"),
        ({"server__tls_cert": str(cert), "server__tls_key": str(other_key)}, "not a PEM certificate chain"),
        ({"cluster__tls_ca": str(garbage)}, "not a PEM CA bundle"),
        ({"cluster__tls_ca": str(tmp_path / "absent.pem")}, "does not exist"),
    ]
    for flags, message in cases:
        with pytest.raises(ConfigError, match=message):
            load("proxy", None, flags, env={})
    assert load("proxy", None, {"cluster__tls_ca": str(other_cert)}, env={}).cluster.tls_ca == str(other_cert)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_key_is_a_config_error(tmp_path):
    cert, key = self_signed(tmp_path)
    key.chmod(0)
    with pytest.raises(ConfigError, match="cannot be read"):
        load("proxy", None, {"server__tls_cert": str(cert), "server__tls_key": str(key)}, env={})


def test_tls_is_for_proxy_and_metaserver_only(tmp_path, model_dir):
    cert, key = self_signed(tmp_path)
    tls = {"server__tls_cert": str(cert), "server__tls_key": str(key), "model__path": str(model_dir),
           "cluster__token": "t" * 32}
    for role in ("pd", "elastic-server", "all"):
        with pytest.raises(ConfigError, match="for the proxy and metaserver roles"):
            load(role, None, tls, env={})


def test_internal_ports_off_loopback_need_a_token(model_dir):
    wide = {"server__host": "0.0.0.0", "model__path": str(model_dir)}
    for role, extra in (("proxy", {}), ("metaserver", {}), ("prefill", {"kv__connector": "pull"}),
                        ("decode", {"kv__connector": "push"})):
        with pytest.raises(ConfigError, match="set cluster.token") as err:
            load(role, None, {**wide, **extra}, env={})
        assert "allow_unauthenticated" in str(err.value)
        assert load(role, None, {**wide, **extra, "cluster__token": "s" * 32}, env={}).cluster.token
        opened = load(role, None, {**wide, **extra, "cluster__allow_unauthenticated": True}, env={})
        assert any(w.startswith("UNAUTHENTICATED") for w in security_warnings(opened))
        for loopback in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
            local = load(role, None, {**wide, **extra, "server__host": loopback}, env={})
            assert any("not set" in w for w in security_warnings(local))
    # nothing of ours listens: vLLM with the example connector, pd; they start, with a warning that their
    # HTTP routes are open to the network (with a token, the client API would take it: engine/middleware)
    for role in ("pd", "prefill", "encoder"):
        opened = load(role, None, wide, env={})
        assert opened.server.host == "0.0.0.0"
        assert any(w.startswith("UNAUTHENTICATED: this engine serves its client API")
                   for w in security_warnings(opened))
        for quiet in ({"cluster__token": "s" * 32}, {"server__host": "127.0.0.1"}):
            assert not any("client API" in w for w in security_warnings(load(role, None, {**wide, **quiet}, env={})))
    assert load("prefill", None, wide, env={}).kv.connector == "example"


def test_flags_and_env_twins_reach_the_security_keys(tmp_path):
    cert, key = self_signed(tmp_path)
    env = {"ASCENDSERVE_TLS_CERT": str(cert), "ASCENDSERVE_TLS_KEY": str(key), "ASCENDSERVE_TLS_CA": str(cert),
           "ASCENDSERVE_MAX_CONNECTIONS": "77", "ASCENDSERVE_MAX_BODY_MB": "2.5",
           "ASCENDSERVE_ALLOW_UNAUTHENTICATED": "true", "ASCENDSERVE_HOST": "0.0.0.0"}
    c = load("proxy", None, {}, env=env)
    assert (c.server.tls_cert, c.server.tls_key, c.cluster.tls_ca) == (str(cert), str(key), str(cert))
    assert (c.server.max_connections, c.proxy.max_body_mb, c.cluster.allow_unauthenticated) == (77, 2.5, True)
    r = subprocess.run([sys.executable, "-m", "ascendserve", "--role", "proxy", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--max-connections", "--max-body-mb",
                 "--allow-unauthenticated"):
        assert flag in r.stdout, flag


def test_server_limits_reach_granian(tmp_path):
    cert, key = self_signed(tmp_path)
    c = load("proxy", None, {"server__tls_cert": str(cert), "server__tls_key": str(key)}, env={})
    c.server.max_connections, c.server.max_header_kb, c.server.header_timeout_s = 100, 16, 2.5
    options = granian_options(c.server)
    assert options["backpressure"] == 100 and str(options["http"]) == "1"
    assert options["http1_settings"].max_buffer_size == 16 * 1024
    assert options["http1_settings"].header_read_timeout == 2500
    assert options["ssl_cert"] == cert and options["ssl_key"] == key
    assert "ssl_cert" not in granian_options(load("proxy", None, {}, env={}).server)


def test_redacted_config_and_warnings_hold_no_secret():
    token, key, backend = "tok-0123456789abcdef", "key-0123456789abcdef", "backend-0123456789"
    c = load("proxy", None, {"cluster__token": token, "proxy__api_keys": [key],
                             "proxy__backend_api_key": backend}, env={})
    dumped = json.dumps(redacted(c)) + "".join(security_warnings(c))
    assert token not in dumped and key not in dumped and backend not in dumped
    assert security_warnings(load("proxy", None, {"cluster__token": "short"}, env={}))[0].startswith(
        "cluster.token is short")


def _render(formatter: logging.Formatter, message: str, *args) -> str:
    record = logging.LogRecord("vllm.x", logging.INFO, __file__, 1, message, args, None)
    return formatter.format(record)


def test_secrets_are_masked_in_every_rendered_line(monkeypatch):
    monkeypatch.setenv("ASCENDSERVE_CLUSTER_TOKEN", "env-token-value-1")
    monkeypatch.setenv("ASCENDSERVE_API_KEY", "list-key-one,list-key-two")
    formatter = make_formatter("proxy", "p-1", "json", secrets=["given-secret-1", 'quo"te-secret', "tiny"])
    line = _render(formatter, "leaked %s %s %s %s %s %s", "given-secret-1", "env-token-value-1",
                   "list-key-two", 'quo"te-secret', "tiny", "prefix-given-secret-1-suffix")
    event = json.loads(line)["event"]
    for secret in ("given-secret-1", "env-token-value-1", "list-key-two", "quote-secret", "te-secret"):
        assert secret not in line, secret
    assert event == "leaked *** *** *** *** tiny prefix-***-suffix"  # below 6 characters: not masked
    console = _render(make_formatter("proxy", "p-1", "console", secrets=["given-secret-1"]), "x given-secret-1")
    assert "given-secret-1" not in console and "***" in console


def test_body_limit_answers_from_the_header_before_the_app():
    import asyncio

    from ascendserve.web.body_limit import BodyLimit

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def call(headers):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"x" * 100, "more_body": False}

        await BodyLimit(app, max_bytes=100)({"type": "http", "headers": headers}, receive, send)
        return sent[0]["status"], (json.loads(sent[1]["body"])["error"]["message"] if sent[1]["body"] else "")

    assert asyncio.run(call([(b"content-length", b"100")])) == (204, "")
    assert asyncio.run(call([])) == (204, "")  # no length: Litestar counts the body as it is read
    assert asyncio.run(call([(b"Content-Length", b"101")])) == (413, "request body too large")
    assert asyncio.run(call([(b"content-length", b"abc")])) == (400, "invalid Content-Length header")
    assert asyncio.run(call([(b"content-length", b"-5")])) == (400, "invalid Content-Length header")


def test_a_refused_body_is_read_before_the_connection_closes():
    """A 413 sent while the client still writes its body, then a close with those bytes unread, is
    a TCP reset that can discard the 413 before the client reads it: the rest is drained first,
    up to a bound (4x the limit, at least 4 MiB) and a deadline, so a huge body cannot hold it."""
    import asyncio

    from ascendserve.web import body_limit
    from ascendserve.web.body_limit import BodyLimit

    async def app(scope, receive, send):
        raise AssertionError("the app must not run")

    async def call(total: int, chunk: int, stall_after: int | None = None):
        sent, read = [], [0]

        async def send(message):
            sent.append(message)

        async def receive():
            if stall_after is not None and read[0] >= stall_after:
                await asyncio.sleep(60)  # a client that stops sending
            n = min(chunk, total - read[0])
            read[0] += n
            return {"type": "http.request", "body": b"x" * n, "more_body": read[0] < total}

        started = asyncio.get_running_loop().time()
        await BodyLimit(app, max_bytes=100)({"type": "http", "headers": [(b"content-length", str(total).encode())]},
                                            receive, send)
        return sent[0]["status"], read[0], asyncio.get_running_loop().time() - started

    assert asyncio.run(call(5000, 1000))[:2] == (413, 5000)  # all of it, after the answer
    status, read, _ = asyncio.run(call(64 << 20, 1 << 20))
    assert status == 413 and (4 << 20) <= read <= (5 << 20), read  # bounded
    body_limit.DRAIN_S, saved = 0.3, body_limit.DRAIN_S
    try:
        status, read, took = asyncio.run(call(5000, 1000, stall_after=2000))
    finally:
        body_limit.DRAIN_S = saved
    assert status == 413 and read == 2000 and took < 2, (read, took)


def test_a_response_before_the_body_was_read_closes_the_connection_after_draining_it():
    """Measured in CI: a route that ignores its body answered 200 on a keep-alive connection, the
    server then dropped the connection over the unread body, and the client's next POST on it got
    "server disconnected without sending a response". Such a response now says connection: close and
    the rest is read first; a route that read its body keeps the connection."""
    import asyncio

    from ascendserve.web.body_limit import BodyLimit

    def app_reading(reads: bool):
        async def app(scope, receive, send):
            if reads:
                while (await receive()).get("more_body"):
                    pass
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"Connection", b"keep-alive")]})
            await send({"type": "http.response.body", "body": b"{}"})
        return app

    async def call(app, headers, total=5000, chunk=1000):
        sent, read = [], [0]

        async def send(message):
            sent.append(message)

        async def receive():
            n = min(chunk, total - read[0])
            read[0] += n
            return {"type": "http.request", "body": b"x" * n, "more_body": read[0] < total}

        await BodyLimit(app, max_bytes=10_000)({"type": "http", "headers": headers}, receive, send)
        return [v for k, v in sent[0]["headers"] if k.lower() == b"connection"], read[0], sent[1]["body"]

    for headers in ([(b"content-length", b"5000")], [(b"transfer-encoding", b"chunked")]):
        assert asyncio.run(call(app_reading(False), headers)) == ([b"close"], 5000, b"{}")
        assert asyncio.run(call(app_reading(True), headers)) == ([b"keep-alive"], 5000, b"{}")
    # no body: untouched, nothing read
    assert asyncio.run(call(app_reading(False), [], total=0)) == ([b"keep-alive"], 0, b"{}")
