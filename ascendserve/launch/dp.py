"""`ascendserve launch`: the external data-parallel launcher.

    ascendserve launch --role decode --model DIR --dp-size 4 --dp-size-local 2 \\
        --dp-rank-start 2 --dp-address 10.0.0.1 --dp-rpc-port 13345 \\
        --engine-port 8100 --tp-size 1 [any other flag of the role ...]
    ascendserve launch --role decode --config decode.toml   # the same from [engine]

Starts `dp-size-local` engine processes on this node: local rank i is global
DP rank `dp-rank-start + i`, serves on `engine-port + i`, and sees devices
`[i*tp, (i+1)*tp)` (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES, or a
block of cores through VLLM_CPU_OMP_THREADS_BIND on CPUs). Every flag it does
not know goes to each rank unchanged (--metaserver-url: each rank registers,
and the proxy balances over them; --enable-expert-parallel: experts sharded
over all TP x DP ranks). Flags left out come from the role's --config
([engine] data_parallel_size, data_parallel_size_local, data_parallel_rank_start,
data_parallel_address, data_parallel_rpc_port, tensor_parallel_size). Ranks
are supervised: one that dies is reported and restarted with a backoff; one
that fails to start `--start-limit` times in a row (exits before its /health
answered) is given up, its last output lines printed, the other ranks stopped,
and the launcher exits with status 1.

vLLM couples DP ranks only for MoE models (their experts are sharded across
ranks); for dense models it refuses --data-parallel-* with external ranks and
asks for independent instances, which is what the ranks then are.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from ascendserve.config import environ
from ascendserve.flags import ENGINE_ROLES, argv_value
from ascendserve.launch.supervisor import (DEFAULT_START_LIMIT, Child, Supervisor, child_log_format, device_nodes,
                                           probe_host, self_command)
from ascendserve.logging import configure, get_logger

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ascendserve launch", description=__doc__.split("\n\n")[0],
                                epilog="Unknown flags are passed to every rank (ascendserve --role ROLE --help).")
    p.add_argument("--role", choices=ENGINE_ROLES, required=True)
    p.add_argument("--model", help="model directory (or model.path in --config)")
    p.add_argument("--config", help="the role's TOML config, passed to every rank")
    p.add_argument("--dp-size", type=int, help="data-parallel ranks in the whole deployment "
                   "(default: engine.data_parallel_size of --config)")
    p.add_argument("--dp-size-local", type=int, help="ranks on this node (default: the rest from --dp-rank-start)")
    p.add_argument("--dp-rank-start", type=int, help="global rank of this node's first rank (default 0)")
    p.add_argument("--node-rank", type=int, help="this node's index (env ASCENDSERVE_NODE_RANK; on Kubernetes the "
                   "pod ordinal): --dp-rank-start = node rank x --dp-size-local")
    p.add_argument("--dp-address", help="DP master address (rank 0's node; MoE only; default 127.0.0.1)")
    p.add_argument("--dp-rpc-port", type=int, help="DP master RPC port (MoE only; default 13345)")
    p.add_argument("--engine-port", type=int, default=8100, help="HTTP port of local rank 0; rank i: + i")
    p.add_argument("--tp-size", type=int, help="tensor-parallel devices per rank (default 1)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    p.add_argument("--restart-backoff-max", type=float, default=30.0, metavar="S")
    p.add_argument("--start-limit", type=int, default=DEFAULT_START_LIMIT, metavar="N",
                   help="give up (exit 1) on a rank that fails to start N times in a row; 0: never "
                        f"(default {DEFAULT_START_LIMIT})")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="auto")
    return p


def detect_device() -> str:
    nodes = device_nodes()
    return "npu" if nodes["davinci"] else "cuda" if nodes["nvidia"] else "cpu"


def is_moe(model_dir: str) -> bool:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    configs = [cfg, cfg.get("text_config") or {}]
    return any(c.get(k) for c in configs for k in MOE_KEYS)


def device_env(device: str, local_rank: int, tp: int, env: dict[str, str], cores: list[int],
               ranks: int) -> dict[str, str]:
    """What makes local rank `local_rank` use device block [local_rank*tp, (local_rank+1)*tp)."""
    block = range(local_rank * tp, (local_rank + 1) * tp)
    if device in VISIBLE:
        visible = env.get(VISIBLE[device], "")
        ids = visible.split(",") if visible else [str(i) for i in range(block.stop)]
        if len(ids) < block.stop:
            raise ValueError(f"local rank {local_rank} needs devices {block.start}..{block.stop - 1} of "
                             f"{VISIBLE[device]}={visible}")
        return {VISIBLE[device]: ",".join(ids[i] for i in block)}
    # CPU: each TP rank of each local DP rank gets its own block of this process's cores
    # (more ranks than cores: blocks of one core, shared round-robin), in vLLM's syntax "0-3|4-7"
    per = max(1, len(cores) // (ranks * tp))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        _cpu_list([cores[(slot * per + k) % len(cores)] for k in range(per)]) for slot in block)}


def _cpu_list(ids: list[int]) -> str:
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def rank_children(args, passthrough: list[str], cli: list[str], env: dict[str, str],
                  device: str, moe: bool) -> list[Child]:
    local = args.dp_size_local
    cores = sorted(os.sched_getaffinity(0))
    host = probe_host(argv_value(passthrough, "--host") or env.get("ASCENDSERVE_HOST", ""))
    children = []
    for i in range(local):
        rank = args.dp_rank_start + i
        port = args.engine_port + i
        argv = [*cli, "--role", args.role, "--port", str(port), "--tensor-parallel-size", str(args.tp_size),
                "--log-level", args.log_level, "--log-format", child_log_format(args.log_format),
                "--host-engines", str(local)]  # the ranks on this node share its free memory (CPU hosts)
        if args.model:
            argv += ["--model", args.model]
        if args.config:
            argv += ["--config", args.config]
        if args.role in ("prefill", "decode"):  # each TP rank of each DP rank needs its own side channel
            argv += ["--kv-port", str(args.engine_port + 1000 + i * args.tp_size)]
        if moe:
            argv += ["--data-parallel-size", str(args.dp_size), "--data-parallel-rank", str(rank),
                     "--data-parallel-address", args.dp_address, "--data-parallel-rpc-port", str(args.dp_rpc_port)]
        else:  # independent instances, whatever the config file says
            argv += ["--data-parallel-size", "1"]
        child_env = device_env(device, i, args.tp_size, env, cores, local)
        children.append(Child(f"{args.role}-dp{rank}", [*argv, *passthrough], child_env,
                              ready_url=f"http://{host}:{port}/health"))
    return children


def _check(args) -> str | None:
    if args.dp_size is None:
        return "--dp-size (or engine.data_parallel_size in --config) is required"
    if args.node_rank is not None:
        if args.node_rank < 0:
            return "--node-rank (ASCENDSERVE_NODE_RANK) must be an integer >= 0"
        if args.dp_size_local is None or args.dp_rank_start != args.node_rank * args.dp_size_local:
            return (f"--node-rank {args.node_rank} needs --dp-size-local, and gives --dp-rank-start = node rank x "
                    "local ranks: do not set a different --dp-rank-start")
    local = args.dp_size_local
    if args.dp_size < 1 or local < 1 or args.tp_size < 1:
        return "--dp-size, --dp-size-local and --tp-size must be >= 1"
    if args.start_limit < 0:
        return "--start-limit must be >= 0 (0: never give up)"
    if args.dp_rank_start < 0 or args.dp_rank_start + local > args.dp_size:
        return (f"ranks {args.dp_rank_start}..{args.dp_rank_start + local - 1} do not fit in --dp-size "
                f"{args.dp_size}")
    if not 1 <= args.engine_port <= 65535 - local - 1000 * (args.role in ("prefill", "decode")):
        return f"--engine-port {args.engine_port} leaves no room for {local} ranks"
    return None


def _role_config(args, env: dict[str, str]):
    """The role's --config as every rank will read it (None without one)."""
    if not args.config:
        return None
    from ascendserve.config import load

    flags = {"model__path": args.model} if args.model else {}
    return load(args.role, args.config, flags, env)


def resolve(args, config, env: dict[str, str] | None = None) -> None:
    """Launcher flags left out: from the config's [engine], then the defaults; a node rank (flag or
    ASCENDSERVE_NODE_RANK) gives the rank start."""
    e = config.engine if config is not None else None
    pick = (lambda flag, key, default: flag if flag is not None else getattr(e, key) if e is not None else default)
    if args.node_rank is None and (env or {}).get("ASCENDSERVE_NODE_RANK", "").strip():
        try:
            args.node_rank = int(env["ASCENDSERVE_NODE_RANK"])
        except ValueError:
            args.node_rank = -1  # refused by _check
    args.dp_size = pick(args.dp_size, "data_parallel_size", None)
    args.dp_size_local = pick(args.dp_size_local, "data_parallel_size_local", None)
    if args.node_rank is not None and args.dp_rank_start is None and args.dp_size_local is not None:
        args.dp_rank_start = args.node_rank * args.dp_size_local
    args.dp_rank_start = pick(args.dp_rank_start, "data_parallel_rank_start", 0)
    args.dp_address = pick(args.dp_address, "data_parallel_address", "127.0.0.1")
    args.dp_rpc_port = pick(args.dp_rpc_port, "data_parallel_rpc_port", 13345)
    args.tp_size = pick(args.tp_size, "tensor_parallel_size", 1)
    if args.dp_size_local is None and args.dp_size is not None:
        args.dp_size_local = args.dp_size - args.dp_rank_start


def _model_path(args, config, env: dict[str, str]) -> str:
    if args.model:
        return args.model
    if config is not None:
        return config.model.path
    return env.get("ASCENDSERVE_MODEL", "")


def main(argv: list[str]) -> int:
    args, passthrough = parser().parse_known_args(argv)
    env = environ()
    from ascendserve.config import ConfigError

    try:
        config = _role_config(args, env)
    except ConfigError as exc:
        print(f"ascendserve launch: error: {exc}", file=sys.stderr)
        return 2
    resolve(args, config, env)
    if error := _check(args):
        print(f"ascendserve launch: error: {error}", file=sys.stderr)
        return 2
    configure("launch", f"launch-{args.role}-{args.dp_rank_start}", args.log_level, args.log_format)
    log = get_logger("ascendserve.launch")
    device = detect_device() if args.device == "auto" else args.device
    model = _model_path(args, config, env)
    moe = is_moe(model)
    cli = self_command()
    try:
        children = rank_children(args, passthrough, cli, env, device, moe)
    except ValueError as exc:
        print(f"ascendserve launch: error: {exc}", file=sys.stderr)
        return 2
    log.info("launching data-parallel ranks", role=args.role, device=device, dp_size=args.dp_size,
             ranks=[c.name for c in children], ports=[args.engine_port + i for i in range(len(children))],
             coupling="vLLM data parallel (MoE)" if moe else "independent instances (dense model)")
    supervisor = Supervisor(children, env, args.restart_backoff_max, start_limit=args.start_limit)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: supervisor.stopping.set())
    supervisor.start_all()
    try:
        supervisor.run()
    finally:
        supervisor.stop_all()
    return supervisor.exit_code()
