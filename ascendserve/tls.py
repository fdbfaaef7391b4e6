"""TLS for the HTTP control plane: the server's certificate files and the clients' trust.

Servers (proxy, metaserver) take a PEM certificate chain and key
(`server.tls_cert`, `server.tls_key`). Clients inside the cluster (the proxy,
the metaserver, engine heartbeats, push-mode callbacks, NetLoader's seed
lookup) trust the system's CAs plus `cluster.tls_ca`, a PEM bundle, so a
private or self-signed certificate verifies. Standard library only: engine
processes and control-plane processes both import this.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def _readable(key: str, path: str) -> str | None:
    p = Path(path)
    if not p.is_file():
        return f"{key} = {path!r} does not exist or is not a file"
    try:
        with p.open("rb") as f:
            f.read(1)
    except OSError as exc:
        return f"{key} = {path!r} cannot be read: {exc.strerror or exc}"
    return None


def server_files_problem(cert: str, key: str) -> str | None:
    """Why this certificate/key pair cannot serve TLS, or None when it can."""
    if bool(cert) != bool(key):
        return "server.tls_cert and server.tls_key go together: set both (PEM files) or neither"
    for name, path in (("server.tls_cert", cert), ("server.tls_key", key)):
        if (problem := _readable(name, path)) is not None:
            return problem
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as exc:  # the message names no secret: the key file's bytes stay out
        return (f"server.tls_cert = {cert!r} / server.tls_key = {key!r} are not a PEM certificate chain "
                f"and its unencrypted private key ({exc.__class__.__name__}: {getattr(exc, 'reason', None) or exc})")
    return None


def ca_file_problem(ca: str) -> str | None:
    if (problem := _readable("cluster.tls_ca", ca)) is not None:
        return problem
    try:
        ssl.create_default_context().load_verify_locations(cafile=ca)
    except (ssl.SSLError, ValueError) as exc:
        return f"cluster.tls_ca = {ca!r} is not a PEM CA bundle ({getattr(exc, 'reason', None) or exc})"
    return None


def client_context(ca: str) -> ssl.SSLContext | None:
    """Verification for https URLs inside the cluster: the system's CAs plus `ca`.
    None when no CA file is configured (clients then use their own default)."""
    if not ca:
        return None
    context = ssl.create_default_context()
    context.load_verify_locations(cafile=ca)
    return context
