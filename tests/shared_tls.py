"""One TLS context for every httpx client the tests and benches make in a process.

`httpx.get(...)` / `httpx.post(...)` build a Client, and each Client builds an SSL context,
loading certifi's CA bundle: 55 ms of CPU on this 2-core host, against 0.3 ms for the request
itself on a kept client. The suite makes thousands of such calls (every readiness poll of
Proc.wait_ready, every kv_usage and /metrics read in a wait_for, every request of
tests/traffic.py), and a sampled CI run (2026-12-03) found the two pytest workers using 15-20 %
of the machine, most of it in ssl.create_default_context. `install()` makes httpx's transports
reuse the context per (verify, trust_env) when verify is True or False and no client
certificate is given; a test that passes its own CA file or SSLContext (test_security's TLS
checks) gets exactly what it asked for, as before. A shared SSLContext is safe: clients read
it, and httpcore sets the same ALPN list on it for every connection of a given HTTP version.
This changes the test harness's clients only; the product builds its own contexts.
"""

from __future__ import annotations

import functools
import os

PATCHED = "_ascendserve_shared_tls"


def install() -> bool:
    """Share the contexts from now on in this process; idempotent. False when httpx's transport
    no longer builds its context through the name this relies on (then nothing is changed)."""
    from httpx._transports import default

    original = getattr(default, "create_ssl_context", None)
    if original is None:
        return False
    if getattr(original, PATCHED, False):
        return True

    @functools.lru_cache(maxsize=16)
    def cached(verify: bool, trust_env: bool, cert_file: str | None, cert_dir: str | None):
        return original(verify=verify, cert=None, trust_env=trust_env)

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if isinstance(verify, bool) and cert is None:
            # the variables httpx reads for verify=True are part of the key
            return cached(verify, bool(trust_env), os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return original(verify=verify, cert=cert, trust_env=trust_env)

    setattr(create_ssl_context, PATCHED, True)
    default.create_ssl_context = create_ssl_context
    return True
