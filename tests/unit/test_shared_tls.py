"""tests/shared_tls.py: the suite's httpx clients share one TLS context, and only where that
changes nothing (no network: contexts are built, no connection is made)."""

from __future__ import annotations

import ssl
import time

import httpx
from httpx._transports import default

from tests import shared_tls


def _context(client: httpx.Client) -> ssl.SSLContext:
    return client._transport._pool._ssl_context


def test_default_clients_share_one_context_and_cost_little():
    assert shared_tls.install() and shared_tls.install()  # installed (conftest did), idempotent
    with httpx.Client() as a, httpx.Client() as b:
        assert _context(a) is _context(b)
        assert _context(a).verify_mode == ssl.CERT_REQUIRED and _context(a).check_hostname
    with httpx.Client(verify=False) as c, httpx.Client(verify=False) as d:
        assert _context(c) is _context(d) is not _context(a)
        assert _context(c).verify_mode == ssl.CERT_NONE
    started = time.process_time()
    for _ in range(50):
        httpx.Client().close()
    assert time.process_time() - started < 50 * 0.02  # a fresh context costs ~55 ms of CPU each here


def test_a_ca_file_a_context_or_the_environment_gets_its_own(tmp_path, monkeypatch):
    import certifi

    mine = ssl.create_default_context()
    with httpx.Client(verify=mine) as a:
        assert _context(a) is mine
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    first = default.create_ssl_context()
    monkeypatch.setenv("SSL_CERT_FILE", certifi.where())
    assert default.create_ssl_context() is not first  # httpx reads the variable for verify=True
    monkeypatch.delenv("SSL_CERT_FILE")
    assert default.create_ssl_context() is first
