"""Config -> vLLM arguments, and vLLM's OpenAI server run in this process.

The role decides the vLLM settings that make it that role (connectors,
encoder-only mode); everything else passes through from `[engine.vllm]`
or `--vllm-arg`. vLLM's import paths move between releases: every import
of vLLM's server internals lives in `_run()` below and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from ascendserve import otel_env
from ascendserve.config import Config, ConfigError, environ, redact_args
from ascendserve.discovery.etcd import EtcdSettings
from ascendserve.engine.host_defaults import engine_dtype, memory_args, process_env
from ascendserve.engine.kv_args import kv_env, kv_transfer_config
from ascendserve.engine.kv_events import events_args, events_env
from ascendserve.engine.startup_stop import StartupInterrupted, _StartupStop
from ascendserve.logging import get_logger, vllm_dictconfig
from ascendserve.security import is_loopback

# Settings the role owns; passing them through would silently change the role.
OWNED = {
    "model": "model.path / --model",
    "host": "server.host / --host",
    "port": "server.port / --port",
    "served-model-name": "model.served_name / --served-model-name",
    "tensor-parallel-size": "engine.tensor_parallel_size / --tensor-parallel-size",
    "data-parallel-size": "engine.data_parallel_size / --data-parallel-size",
    "data-parallel-rank": "engine.data_parallel_rank / --data-parallel-rank",
    "data-parallel-size-local": "engine.data_parallel_size_local / --data-parallel-size-local",
    "data-parallel-address": "engine.data_parallel_address / --data-parallel-address",
    "data-parallel-rpc-port": "engine.data_parallel_rpc_port / --data-parallel-rpc-port",
    "enable-expert-parallel": "engine.enable_expert_parallel / --enable-expert-parallel",
    "kv-transfer-config": "[kv] (the role picks the KV side)",
    "ec-transfer-config": "[ec] (the role picks the EC side)",
    "mm-encoder-only": "--role encoder",
    "kv-events-config": "[kv_events] (--kv-events, --kv-events-host, --kv-events-port)",
}

EC_CONNECTORS = {"example": "ECExampleConnector", "shm": "AscendECShmConnector", "store": "AscendECStoreConnector"}
EC_MODULE = "ascendserve.connectors.ec.connector"
MIDDLEWARE = "ascendserve.engine.middleware.EngineMiddleware"
HTTP_SHUTDOWN_S = 5  # longest wait for open HTTP connections once the engine has stopped


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def ec_transfer_config(config: Config, ec_role: str) -> dict:
    ec = config.ec
    if ec.connector == "example":
        return {"ec_connector": EC_CONNECTORS["example"], "ec_role": ec_role,
                "ec_connector_extra_config": {"shared_storage_path": ec.path}}
    if ec.connector == "store" and ec.store_backend == "memcached" and not ec.store_url:
        raise ConfigError("ec.connector = 'store' with the memcached backend needs ec.store_url "
                          "(--ec-store-url host:port)")
    if ec.connector == "store" and ec.store_backend == "mooncake" and not ec.mooncake_master:
        raise ConfigError("ec.store_backend = 'mooncake' needs ec.mooncake_master (--ec-mooncake-master host:port)")
    extra = {
        "backend": "shm" if ec.connector == "shm" else ec.store_backend,
        "shm_name": ec.shm_name, "shm_bytes": ec.shm_size_mb << 20, "block_bytes": ec.block_kb << 10,
        "store_url": ec.store_url, "chunk_bytes": ec.chunk_kb << 10, "ttl_s": ec.ttl_s, "wait_s": ec.wait_s,
        "pin_ttl_s": ec.pin_ttl_s, "recv_buffer_tokens": ec.recv_buffer_tokens,
        "mooncake_master": ec.mooncake_master, "mooncake_segment_bytes": ec.mooncake_segment_mb << 20,
        "local_host": config.cluster.advertise_host,
        # receive regions are named after this (the main) process, which removes them when it exits:
        # vLLM kills its engine processes at shutdown, so they cannot clean up themselves
        "recv_prefix": f"asf-ec-recv-{os.getpid()}",
    }
    return {"ec_connector": EC_CONNECTORS[ec.connector], "ec_connector_module_path": EC_MODULE,
            "ec_role": ec_role, "ec_connector_extra_config": extra}


def _check_processor_cache(config: Config) -> None:
    """Cross-process EC reuse needs the consumer's in-process processor cache off."""
    args = list(config.engine.vllm_args)
    for key, value in config.engine.vllm.items():
        args += _option(key, value)
    for i, arg in enumerate(args):
        if _arg_key(arg) != "mm-processor-cache-gb":
            continue
        value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
        try:
            zero = float(value) == 0
        except ValueError:
            zero = False
        if not zero:
            raise ConfigError(
                f"mm_processor_cache_gb = {value} on an EC consumer: with the encoder in another process the "
                "in-process multimodal processor cache must be off (vLLM would skip sending an item it has "
                "processed before, and the encoder output could not be matched); remove the setting, "
                "ascendserve sets it to 0")


def role_args(config: Config) -> list[str]:
    """The vLLM arguments that make this process its role."""
    role = config.role
    args: list[str] = []
    if role == "encoder":
        args += ["--mm-encoder-only", "--no-enable-prefix-caching"]
        args += ["--ec-transfer-config", _json(ec_transfer_config(config, "ec_producer"))]
    if role == "prefill":
        args += ["--kv-transfer-config", _json(kv_transfer_config(config, "kv_producer"))]
    if role == "decode":
        args += ["--kv-transfer-config", _json(kv_transfer_config(config, "kv_consumer"))]
    if config.netloader.sources:
        settings = {"sources": config.netloader.sources, "fallback": config.netloader.fallback,
                    "timeout_s": config.netloader.timeout_s, "streams": config.netloader.streams,
                    "metaserver_url": config.cluster.metaserver_url,
                    "tls_ca": config.cluster.tls_ca}
        if config.registry.backend == "etcd":  # seeds found in etcd; its password from the environment
            settings["etcd"] = EtcdSettings.from_config(config).to_dict()
        args += ["--load-format", "netloader", "--model-loader-extra-config", _json({"netloader": settings})]
    if role in ("prefill", "pd") and config.ec.enabled:
        # Cross-process EC reuse needs the in-process processor cache off,
        # or vLLM skips sending the item the encoder already produced.
        _check_processor_cache(config)
        args += ["--ec-transfer-config", _json(ec_transfer_config(config, "ec_consumer"))]
        args += ["--mm-processor-cache-gb", "0"]
    return args


def _option(key: str, value: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + key.replace("_", "-")]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    if isinstance(value, dict):
        return [flag, _json(value)]
    return [flag, str(value)]


def _arg_key(arg: str) -> str | None:
    if not arg.startswith("--"):
        return None
    key = arg[2:].split("=", 1)[0].replace("_", "-")
    return key[3:] if key.startswith("no-") and key[3:] in OWNED else key


def passthrough_args(config: Config) -> list[str]:
    """`[engine.vllm]` then `--vllm-arg`, refusing settings the role owns."""
    args: list[str] = []
    for key, value in config.engine.vllm.items():
        args += _option(key, value)
    args += config.engine.vllm_args
    for arg in args:
        key = _arg_key(arg)
        if key in OWNED:
            raise ConfigError(
                f"vLLM argument --{key} is set by ascendserve; use {OWNED[key]} instead"
            )
    return args


def build_argv(config: Config, env: dict[str, str] | None = None) -> list[str]:
    """`env`: the process environment (config.environ()), for the standard OTEL_* variables."""
    e = config.engine
    dtype = engine_dtype(config)  # read once: the KV size depends on it
    argv = [
        "--model", config.model.path,
        "--host", config.server.host,
        "--port", str(config.server.port),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--dtype", dtype,
        "--middleware", MIDDLEWARE,
        "--disable-uvicorn-access-log",
    ]
    if config.model.served_name:
        argv += ["--served-model-name", config.model.served_name]
    for key in ("max_model_len", "max_num_seqs"):
        if getattr(e, key) is not None:
            argv += _option(key, getattr(e, key))
    argv += memory_args(config, dtype=dtype)
    if e.enforce_eager:
        argv.append("--enforce-eager")
    user = passthrough_args(config)
    # vLLM's own spans go where the proxy's do, under the traceparent each hop carries
    traces = otel_env.vllm_args(environ() if env is None else env, user)
    return argv + parallel_args(config) + role_args(config) + events_args(config, user) + traces + user


def parallel_args(config: Config) -> list[str]:
    """Data / expert parallelism: internal DP (no rank) or one external rank."""
    e = config.engine
    args = []
    if (e.data_parallel_size > 1 and e.data_parallel_rank is None and config.role in ("prefill", "decode")
            and config.kv.connector in ("pull", "push")):
        raise ConfigError("internal data parallelism (engine.data_parallel_size > 1 without a rank) would put "
                          "every rank's KV side channel behind one address: start the ranks with "
                          "`ascendserve launch` (one process, one side channel and one registration per rank)")
    if e.data_parallel_size > 1:
        args += ["--data-parallel-size", str(e.data_parallel_size),
                 "--data-parallel-address", e.data_parallel_address,
                 "--data-parallel-rpc-port", str(e.data_parallel_rpc_port)]
        if e.data_parallel_rank is not None:
            args += ["--data-parallel-rank", str(e.data_parallel_rank)]
    if e.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    return args


# A unix socket's path holds at most 107 bytes; vLLM's names are "<dir>/<uuid4>" (36).
_SUN_PATH_MAX = 107


def ipc_dir(config: Config) -> Path | None:
    """Where this instance's vLLM processes bind their ZMQ IPC sockets: a directory of its
    own, `ipc-<instance id>` under runtime_dir (or, when that path is too long for a socket
    name, `asf-ipc-<hash of it>` in the temp dir); None (vLLM's default, the temp dir itself)
    when the user set VLLM_RPC_BASE_PATH. vLLM binds a dozen sockets per engine there and
    does not unlink those of the workers it force-kills at shutdown, nor any of a killed
    instance: one directory per instance, the same for its restarts, is removed whole."""
    if os.environ.get("VLLM_RPC_BASE_PATH"):
        return None
    path = Path(config.runtime_dir).absolute() / f"ipc-{config.instance_id}"
    if len(os.fsencode(path)) + 1 + 36 <= _SUN_PATH_MAX:
        return path
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"asf-ipc-{digest}"


def _fresh_ipc_dir(path: Path) -> None:
    """An empty directory at `path`: what a killed predecessor with this instance id (same
    role, host and port, so not running now) left there goes."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, mode=0o700)


def prepare_environment(config: Config) -> dict[str, str]:
    """Environment vLLM reads in this process and inherits into its children."""
    run_dir = Path(config.runtime_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_file = run_dir / f"logging-{config.instance_id}-{os.getpid()}.json"
    log_file.write_text(
        json.dumps(vllm_dictconfig(config.role or "", config.instance_id, config.log.level, config.log.format))
    )
    ipc = ipc_dir(config)
    if ipc is not None:
        _fresh_ipc_dir(ipc)
    return {
        **({"VLLM_RPC_BASE_PATH": str(ipc)} if ipc is not None else {}),
        "VLLM_CONFIGURE_LOGGING": "1",
        "VLLM_LOGGING_CONFIG_PATH": str(log_file),
        "VLLM_LOGGING_LEVEL": config.log.level.upper(),
        # vLLM's own CLI sets spawn; the fork default breaks accelerators.
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Connectors in vLLM's worker processes read the token from here, not
        # from the engine config, which vLLM logs.
        "ASCENDSERVE_CLUSTER_TOKEN": config.cluster.token,
        **({"ASCENDSERVE_REGISTRY_PASSWORD": config.registry.password} if config.registry.password else {}),
        **kv_env(config),
        **events_env(config, passthrough_args(config)),
        **otel_env.vllm_env(environ()),
        **process_env(),
    }


def serve(config: Config) -> int:
    """Run vLLM's OpenAI server for `config` until it is told to stop."""
    log = get_logger("ascendserve.engine")
    argv = build_argv(config)
    env = prepare_environment(config)
    os.environ.update(env)
    guarded = bool(config.cluster.token) and not is_loopback(config.server.host)
    log.info("starting vLLM", vllm_args=redact_args(argv),
             client_api="cluster token or API key (bound off loopback)" if guarded else "open")
    held = _hold_ec_region(config)
    seed = SeedThread(config).start() if config.netloader.serve else None
    from ascendserve.engine.patches.worker_fork import hold_threads

    hold_threads()  # one OpenMP thread until the engine cores are forked: its workers fork too
    try:
        return _run(argv)
    finally:
        if seed is not None:
            seed.stop()
        Path(env["VLLM_LOGGING_CONFIG_PATH"]).unlink(missing_ok=True)
        if "VLLM_RPC_BASE_PATH" in env:
            shutil.rmtree(env["VLLM_RPC_BASE_PATH"], ignore_errors=True)
        _release_ec_regions(held)


class SeedThread:
    """This instance's weights served to joiners from its own process (netloader.serve).

    Indexing reads every weight once (checksums); it runs beside vLLM's own
    start-up, which reads the same files, so the page cache serves both."""

    def __init__(self, config: Config):
        self.config = config
        self.seed = None
        self._stopping = False
        import threading

        self._thread = threading.Thread(target=self._run, name="netloader-seed-start", daemon=True)

    def start(self) -> "SeedThread":
        self._thread.start()
        return self

    def _run(self) -> None:
        from ascendserve.netloader.checkpoint import CheckpointError, CheckpointIndex, MappedSource
        from ascendserve.netloader.seed import Seed

        log = get_logger("ascendserve.netloader")
        c = self.config
        try:
            source = MappedSource(CheckpointIndex.scan(c.model.path))
            seed = Seed(source, c.cluster.token, c.server.host, c.netloader.port, c.netloader.max_clients,
                        idle_s=c.netloader.timeout_s)
        except (CheckpointError, OSError) as exc:
            log.error("netloader: cannot serve this instance's weights", error=str(exc))
            return
        if self._stopping:
            seed.stop()
            return
        self.seed = seed.start()

    def stop(self) -> None:
        self._stopping = True
        self._thread.join(30)
        if self.seed is not None:
            self.seed.stop()


def _holders_to_wait_for(holders: list[int]) -> list[int]:
    """The holders of the region that are going away, which this instance's last close waits for
    so that it can be the last holder and remove the name:
    - its own processes: its descendants, and the members of its process group that are no
      longer its descendants (vLLM SIGKILLs its engine core before the workers, which are then
      reparented but keep the group and hold the region while they die);
    - the processes of a killed instance: members of a process group whose leader (the role's
      main process, which every launcher starts in a session of its own) is gone; vLLM's
      processes exit when their parent dies, and a SIGKILLed process never closes the region,
      so without the wait nobody unlinks it (the EPD test's SIGKILLed encoder, the chaos test).
    A live instance's holders are not waited for: the last of them removes the name."""
    import psutil

    group = os.getpgid(0)
    try:
        mine = {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        mine = set()
    leaders: dict[int, bool] = {}

    def leader_gone(pgid: int) -> bool:
        if pgid not in leaders:
            try:
                leaders[pgid] = psutil.Process(pgid).status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                leaders[pgid] = True
        return leaders[pgid]

    out = []
    for pid in holders:
        try:
            pgid = os.getpgid(pid)
        except OSError:  # gone meanwhile
            continue
        if pid in mine or pgid == group or (pgid != pid and leader_gone(pgid)):
            out.append(pid)
    return out


def _uses_ec(config: Config) -> bool:
    return config.role == "encoder" or (config.role in ("prefill", "pd") and config.ec.enabled)


def _hold_ec_region(config: Config):
    """This process holds the host's EC region for the instance's life.

    vLLM SIGKILLs its engine processes when it stops, so they never get to
    close it; this process does, and the last holder on the host unlinks it."""
    if not _uses_ec(config) or config.ec.connector != "shm":
        return None
    from ascendserve.connectors.ec.region import Region, RegionError

    try:
        return Region(config.ec.shm_name, size_bytes=config.ec.shm_size_mb << 20, block_size=config.ec.block_kb << 10)
    except RegionError as exc:
        raise ConfigError(str(exc)) from None


def _release_ec_regions(held, wait_s: float = 15.0) -> None:
    if held is not None:
        # vLLM's workers (children of its engine process) outlive the API server's
        # shutdown by a moment and still hold the region: wait for them to go so
        # that this close can be the last one and remove the name
        import time

        deadline = time.monotonic() + wait_s
        # a child that does not hold the region is not waited for: under a test runner or a
        # supervisor this process's descendants are not all vLLM's (_holders_to_wait_for)
        while True:
            others = held.holders()  # live instances' too, and whatever else keeps the name (the log says)
            left = _holders_to_wait_for(others)
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        # a killed holder's lock outlives its descriptors by a moment: the close retries while
        # nobody shows the region open
        unlinked = held.close(settle_s=max(2.0, deadline - time.monotonic()))
        get_logger("ascendserve.engine").info("EC region closed", region=held.name, removed=unlinked,
                                              holders_left=left, other_holders=others,
                                              locked_by=[] if unlinked else held.lock_pids())
    prefix = f"asf-ec-recv-{os.getpid()}"
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


_interrupted_during_startup = False


def interrupted_during_startup() -> bool:
    """Whether this process's vLLM was stopped by a signal before it served (serve() returned)."""
    return _interrupted_during_startup


def _run(argv: list[str]) -> int:
    global _interrupted_during_startup
    stop = _StartupStop()
    try:
        return _run_vllm(argv, stop)
    except StartupInterrupted as exc:
        _interrupted_during_startup = True
        get_logger("ascendserve.engine").info("stopped during start-up", signal=signal.Signals(exc.signum).name)
        return 0


def _run_vllm(argv: list[str], stop: "_StartupStop") -> int:
    from ascendserve.engine.torchvision_compat import ensure_torchvision_importable

    ensure_torchvision_importable()
    from ascendserve.engine import media_errors

    media_errors.install()
    import uvloop
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args

    args = parse_vllm_args(argv)
    configure_logging_from_args(args)
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM rejected the engine arguments: {exc}") from None
    os.environ.update(guard_env(args))  # read by our middleware when vLLM's app serves its first request
    asked: list[int] = []
    try:
        # uvicorn's graceful shutdown waits for every open connection with no deadline: a client that
        # keeps one open (seen: P under push with mooncake) held the stop for 30 s until SIGKILL, which
        # left vLLM's shared memory behind. The engine has stopped by then; what is open cannot finish.
        uvloop.run(_run_server(args, stop, timeout_graceful_shutdown=HTTP_SHUTDOWN_S),
                   loop_factory=_stop_recording_loop(uvloop.Loop, asked))
    except KeyboardInterrupt:
        return 0
    if not asked:
        # vLLM stops its server by itself when its engine died (a worker killed, a crash):
        # exit 0 would keep systemd's Restart=on-failure from restarting the instance
        get_logger("ascendserve.engine").error("vLLM's server stopped without being asked to (its engine died); "
                                               "exiting with status 1")
        return 1
    return 0


async def _run_server(args, stop: _StartupStop, **uvicorn_kwargs) -> None:
    """vLLM's `run_server` with ascendserve's start-up signal handler in place of vLLM's (whose
    KeyboardInterrupt vLLM swallows: see StartupInterrupted). uvicorn replaces it with its own
    handlers once the server is up, as it replaced vLLM's."""
    from vllm.entrypoints.launchers.api_server.entry import run_server_worker
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.utils.system_utils import decorate_logs

    decorate_logs("APIServer", skip_if_decorated=True)
    stop.install()
    listen_address, sock = setup_server(args, reuse_port=False)
    await run_server_worker(listen_address, sock, args, **uvicorn_kwargs)


def parse_vllm_args(argv: list[str]):
    """vLLM's serve arguments, parsed by vLLM's own parser."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="ascendserve (vLLM engine)")).parse_args(argv)


def guard_env(args) -> dict[str, str]:
    """What engine/middleware.ClusterGuard learns from vLLM's parsed arguments: the address vLLM
    binds (off loopback, its client API wants the cluster token or an API key) and the API keys
    vLLM itself accepts, read the way vLLM reads them (`--api-key`, else `VLLM_API_KEY`)."""
    from vllm import envs

    from ascendserve.engine.middleware import API_KEYS_ENV, HOST_ENV

    keys = [key for key in (args.api_key or [envs.VLLM_API_KEY]) if key]
    return {HOST_ENV: args.host or "", API_KEYS_ENV: json.dumps(keys)}


def vllm_http_app(argv: list[str]):
    """vLLM's HTTP app (routes and `--middleware`) for these arguments, without an engine:
    for tests of what the server exposes (the middleware reads guard_env's variables from the
    environment when the app serves its first request: a test sets them)."""
    from vllm.entrypoints.launchers.app import build_app

    return build_app(parse_vllm_args(argv), supported_tasks=("generate",))


def _stop_recording_loop(base: type, asked: list[int]) -> type:
    """An event loop class that records the signals (SIGTERM, SIGINT) that asked vLLM's
    server to stop: vLLM handles them on the loop, and returns the same way either way."""

    class Loop(base):
        def add_signal_handler(self, sig, callback, *args):
            def handler(*a):
                asked.append(sig)
                callback(*a)

            return super().add_signal_handler(sig, handler, *args)

    return Loop

