"""`ascendserve status`: the state of a running cluster, as a table or JSON.

    ascendserve status --proxy URL | --metaserver URL | --etcd URL [URL ...] [--cluster NAME]
                       [--watch [SECONDS]] [--json] [--token-file FILE] [--tls-ca FILE]

A proxy shows its own instances as it routes to them (state, requests in flight, other proxies'
requests, KV usage, KV held for decode, served, failures, the last error), whether it is ready
and its request totals; a metaserver, or etcd directly, the instances registered (load from their
heartbeats). The cluster token comes from ASCENDSERVE_CLUSTER_TOKEN or --token-file, never from a
flag's value (argv shows in ps). Exit 0 when the cluster is ready, 1 when it is not or cannot be
reached, 2 on a usage error or refused credentials; --watch redraws every SECONDS (default 2)
until Ctrl-C, which exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from ascendserve.discovery.etcd import EtcdSettings
from ascendserve.status.fetch import TOKEN_ENV, AuthError, Client, Token, from_etcd, from_metaserver, from_proxy
from ascendserve.status.snapshot import Snapshot
from ascendserve.status.table import render, use_colour
from ascendserve.tls import ca_file_problem, client_context

EXIT_OK, EXIT_NOT_READY, EXIT_USAGE = 0, 1, 2
CLEAR = "\033[H\033[2J"


class UsageError(Exception):
    pass


def _parser(env: dict[str, str]) -> argparse.ArgumentParser:
    # allow_abbrev off: `--token SECRET` must not pass for --token-file (and land in an error message)
    parser = argparse.ArgumentParser(prog="ascendserve status", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False,
                                     epilog=f"The cluster token: ${TOKEN_ENV} or --token-file. Exit codes: "
                                            "0 ready, 1 not ready or unreachable, 2 usage or credentials refused.")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--proxy", metavar="URL", help="a proxy: its instances as it routes to them")
    where.add_argument("--metaserver", metavar="URL", help="a metaserver: the instances registered with it")
    where.add_argument("--etcd", metavar="URL", nargs="+", help="etcd client URLs: the registry read directly")
    parser.add_argument("--cluster",
                        help="with --etcd: the cluster's keys /ascendserve/<cluster>/ (default default; "
                             "env ASCENDSERVE_REGISTRY_CLUSTER)")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                        help="redraw every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--json", action="store_true", help="one JSON document (with --watch: one per line)")
    parser.add_argument("--token-file", metavar="FILE", help=f"a file holding the cluster token (else ${TOKEN_ENV})")
    parser.add_argument("--tls-ca", metavar="FILE", default=env.get("ASCENDSERVE_TLS_CA") or None,
                        help="PEM CA bundle to verify https URLs with, besides the system's (env ASCENDSERVE_TLS_CA)")
    parser.add_argument("--registry-username", metavar="USER",
                        help="with --etcd: the etcd user (env ASCENDSERVE_REGISTRY_USERNAME; the password: "
                             "ASCENDSERVE_REGISTRY_PASSWORD)")
    parser.add_argument("--registry-tls-cert", metavar="FILE", default=env.get("ASCENDSERVE_REGISTRY_TLS_CERT") or "",
                        help="with --etcd: client certificate (mTLS)")
    parser.add_argument("--registry-tls-key", metavar="FILE", default=env.get("ASCENDSERVE_REGISTRY_TLS_KEY") or "",
                        help="with --etcd: client key (mTLS)")
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="per request (default 5)")
    return parser


def token(token_file: str | None, env: dict[str, str]) -> Token | None:
    """The cluster token: --token-file's content, else $ASCENDSERVE_CLUSTER_TOKEN, else none."""
    if token_file:
        try:
            value = Path(token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--token-file {token_file}: cannot be read ({getattr(exc, 'strerror', None) or exc})")
        if not value:
            raise UsageError(f"--token-file {token_file} is empty")
        return Token(value, f"--token-file {token_file}")
    if env.get(TOKEN_ENV):
        return Token(env[TOKEN_ENV], f"${TOKEN_ENV}")
    return None


def base_url(url: str, flag: str) -> str:
    url = url if "://" in url else "http://" + url
    if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
        raise UsageError(f"{flag} {url!r} is not an http(s)://host:port URL")
    return url.rstrip("/")


def reader(args, env: dict[str, str]):
    """A function reading one Snapshot from the source the arguments name."""
    if args.watch is not None and args.watch <= 0:
        raise UsageError(f"--watch {args.watch:g}: the interval must be > 0 seconds")
    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0 seconds")
    if args.tls_ca and (problem := ca_file_problem(args.tls_ca)):
        raise UsageError(problem.replace("cluster.tls_ca", "--tls-ca"))
    if args.etcd:
        return _etcd_reader(args, env)
    if args.cluster or args.registry_username:
        raise UsageError("--cluster and --registry-username go with --etcd")
    flag, url = ("--proxy", args.proxy) if args.proxy else ("--metaserver", args.metaserver)
    client = Client(base_url(url, flag), token(args.token_file, env), client_context(args.tls_ca or ""),
                    args.timeout)
    read = from_proxy if args.proxy else from_metaserver
    return lambda: read(client)


def _etcd_reader(args, env: dict[str, str]):
    cluster = args.cluster or env.get("ASCENDSERVE_REGISTRY_CLUSTER") or "default"
    username = args.registry_username or env.get("ASCENDSERVE_REGISTRY_USERNAME", "")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", cluster):
        raise UsageError(f"--cluster {cluster!r}: 1..64 of letters, digits, '.', '_', '-'")
    password = env.get("ASCENDSERVE_REGISTRY_PASSWORD", "")
    if password and not username:
        raise UsageError("ASCENDSERVE_REGISTRY_PASSWORD is set but no --registry-username")
    if bool(args.registry_tls_cert) != bool(args.registry_tls_key):
        raise UsageError("--registry-tls-cert and --registry-tls-key go together")
    settings = EtcdSettings(tuple(base_url(e, "--etcd") for e in args.etcd), cluster, username=username,
                            password=password, tls_ca=args.tls_ca or "", tls_cert=args.registry_tls_cert,
                            tls_key=args.registry_tls_key)
    try:
        settings.ssl_context()  # the mTLS files load now, or it is a usage error
    except (OSError, ValueError) as exc:
        raise UsageError(f"--registry-tls-cert/--registry-tls-key: {exc}") from None
    return lambda: from_etcd(settings, args.timeout)


def exit_code(snap: Snapshot) -> int:
    return EXIT_OK if snap.ready and not snap.error else EXIT_NOT_READY


def show(snap: Snapshot, args, out, colour: bool, redraw: bool) -> None:
    if args.json:
        out.write(json.dumps(snap.to_dict()) + "\n")
    else:
        text = render(snap, colour) + "\n"
        out.write(CLEAR + text if redraw else text + ("\n" if args.watch is not None else ""))
    out.flush()


def main(argv: list[str], env: dict[str, str] | None = None, out=None, sleep=time.sleep) -> int:
    if env is None:
        from ascendserve.config import environ

        env = environ()
    out = out or sys.stdout
    args = _parser(env).parse_args(argv)
    try:
        read = reader(args, env)
    except UsageError as exc:
        print(f"ascendserve status: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    colour = use_colour(out, env)
    redraw = args.watch is not None and not args.json and bool(getattr(out, "isatty", lambda: False)())
    try:
        while True:
            snap = read()
            show(snap, args, out, colour, redraw)
            if args.watch is None:
                if snap.error and args.json:
                    print(f"ascendserve status: {snap.error}", file=sys.stderr)
                return exit_code(snap)
            sleep(args.watch)
    except AuthError as exc:
        print(f"ascendserve status: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_OK if args.watch is not None else 130
    except BrokenPipeError:  # `status --watch | head`: the reader left
        _silence(out)
        return EXIT_OK


def _silence(out) -> None:
    """Point the closed stdout at /dev/null, so the interpreter's last flush does not complain."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
    except (OSError, ValueError, AttributeError):
        pass
