"""`ascendserve`: parse the command line and hand off to a role or a tool.

    ascendserve --role ROLE [--config FILE] [flags]   run one role
    ascendserve --role ROLE --help                    that role's flags
    ascendserve version
    ascendserve model tiny --kind text|vl|moe|mla --out DIR   random-weight checkpoint
    ascendserve launch --role ROLE --dp-size N ...    data-parallel ranks of one role
    ascendserve doctor [--peers host:port,...] [--npu-peers IP,...]   pre-flight check of this host
    ascendserve status --proxy URL | --metaserver URL | --etcd URL... [--watch [S]] [--json]   cluster state

This module imports neither torch nor vLLM: control-plane roles and --help
must start in well under a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ascendserve import __version__
from ascendserve.config import ConfigError, load, redacted, secrets
from ascendserve.security import security_warnings
from ascendserve.flags import ROLES, flags_for

EXIT_USAGE = 2

# Roles this build can run, and the module that runs each.
ROLE_MODULES = {
    "encoder": "roles.encoder",
    "prefill": "roles.prefill",
    "decode": "roles.decode",
    "pd": "roles.pd",
    "metaserver": "roles.metaserver",
    "proxy": "roles.proxy",
    "elastic-server": "roles.elastic_server",
    "all": "roles.all",
}

ENGINE_ROLES = ("encoder", "prefill", "decode", "pd")  # vLLM runs in the role's own process

ROLE_SUMMARY = {
    "encoder": "multimodal encoder only; publishes encoder outputs (EC) by mm_hash",
    "prefill": "computes prompt KV and hands it to a decode instance",
    "decode": "receives KV, generates and streams tokens",
    "pd": "prefill and decode in one vLLM instance",
    "proxy": "OpenAI-compatible front door routing E -> P -> D",
    "metaserver": "cluster registry and push-mode coordinator",
    "elastic-server": "NetLoader seed streaming weights to joining instances",
    "all": "a whole cluster on one host as supervised children",
}


def _fail(message: str) -> int:
    print(f"ascendserve: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _role_parser(role: str | None) -> argparse.ArgumentParser:
    roles_help = "\n".join(f"  {r:<15} {ROLE_SUMMARY[r]}" for r in ROLES)
    available = "" if role in ROLE_MODULES or role is None else "\n(not available in this build)"
    parser = argparse.ArgumentParser(
        prog="ascendserve",
        description=(f"role {role}: {ROLE_SUMMARY[role]}{available}" if role else
                     "Run one role of a disaggregated LLM serving cluster.\n\nroles:\n" + roles_help
                     + "\n\nother commands:\n  version\n  model tiny --kind text|vl|moe|mla --out DIR"
                     "\n  launch --role ROLE --dp-size N [--dp-size-local L ...]   data-parallel ranks"
                     "\n  doctor [--peers host:port,...] [--npu-peers IP,...]     pre-flight check"
                     "\n  status --proxy URL | --metaserver URL | --etcd URL... [--watch] [--json]   cluster state"),
        epilog="Every flag has an environment twin: --port <-> ASCENDSERVE_PORT. "
               "Precedence: defaults < --config file < environment < flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--role", choices=ROLES, help="which role to run (env ASCENDSERVE_ROLE)")
    parser.add_argument("--config", metavar="FILE", help="TOML config file (env ASCENDSERVE_CONFIG)")
    for flag in flags_for(role):
        kwargs: dict = {"dest": flag.dest, "help": f"{flag.help} (env {flag.env})"}
        if not flag.switch:
            kwargs["metavar"] = flag.name.lstrip("-").upper().replace("-", "_")
        if flag.switch:
            kwargs |= {"action": "store_const", "const": True, "default": None}
        elif flag.repeatable:
            kwargs |= {"action": "append", "default": None, "metavar": "ARG"}
        elif flag.many:
            kwargs |= {"nargs": "+", "default": None}
        parser.add_argument(flag.name, **kwargs)
    return parser


def _model_command(argv: list[str]) -> int:
    from ascendserve.models.tiny import KINDS  # no torch at import: that waits for build()

    parser = argparse.ArgumentParser(prog="ascendserve model", description="model utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="write a random-weight tiny checkpoint (offline)")
    tiny.add_argument("--kind", choices=KINDS, default="text")
    tiny.add_argument("--out", required=True, metavar="DIR")
    tiny.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from ascendserve.models.tiny import TinySpec, build, default_spec

    spec: TinySpec = default_spec(args.kind, seed=args.seed)
    path = build(args.out, spec)
    print(path)
    return 0


def _run_role(argv: list[str], command_line: bool = False) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--role", choices=ROLES)
    known, _ = pre.parse_known_args(argv)
    parser = _role_parser(known.role)
    args = parser.parse_args(argv)
    flag_values = {f.dest: getattr(args, f.dest, None) for f in flags_for(None)}
    try:
        config = load(args.role, args.config, flag_values)
    except ConfigError as exc:
        return _fail(str(exc))
    if config.role not in ROLE_MODULES:
        return _fail(
            f"role {config.role!r} is not available in this build (ascendserve {__version__}); "
            f"available: {', '.join(ROLE_MODULES)}"
        )
    if config.role in ENGINE_ROLES and command_line:
        # before anything starts a thread: the engine's processes get the libraries vLLM preloads
        # into its workers, so that those can be forked (engine/patches/worker_fork.py). Only a
        # process started as this command re-executes itself: main(argv) called by a program
        # would run that program again
        from ascendserve.engine.host_defaults import process_env
        from ascendserve.engine.patches import worker_fork

        worker_fork.reexec_with_preload({**os.environ, **process_env()})
    from ascendserve.logging import configure, get_logger

    configure(config.role, config.instance_id, config.log.level, config.log.format, secrets(config))
    get_logger().info("effective config", config=redacted(config), version=__version__)
    for warning in security_warnings(config):
        get_logger().warning(warning)
    role = importlib.import_module(ROLE_MODULES[config.role])
    try:
        return role.run(config)
    except ConfigError as exc:
        return _fail(str(exc))


def main(argv: list[str] | None = None) -> None:
    command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["version"]:
        print(f"ascendserve {__version__}")
        sys.exit(0)
    if argv[:1] == ["model"]:
        sys.exit(_model_command(argv[1:]))
    if argv[:1] == ["launch"]:
        from ascendserve.launch.dp import main as launch

        sys.exit(launch(argv[1:]))
    if argv[:1] == ["doctor"]:
        from ascendserve.doctor import main as doctor

        sys.exit(doctor(argv[1:]))
    if argv[:1] == ["status"]:
        from ascendserve.status import main as status

        sys.exit(status(argv[1:]))
    sys.exit(_run_role(argv, command_line))

