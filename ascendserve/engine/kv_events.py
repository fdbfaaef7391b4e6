"""`[kv_events]` → vLLM's `--kv-events-config`, and what the instance tells the proxy of its cache.

vLLM publishes every block its prefix cache stores or evicts (vllm/distributed/kv_events.py)
on a ZMQ PUB socket, and keeps the last `buffer_steps` batches for replay on a ROUTER socket.
The proxy subscribes to route a request where its prompt's blocks already are
(router/kv_index.py, router/kv_route.py). The engine role:
  - turns it on for pd and prefill unless `[kv_events] enabled = false`, on `host`
    (127.0.0.1 unless set: the events carry prompt token ids and ZMQ has no authentication),
    port `server.port + 1500` and replay on `server.port + 2500` (internal DP ranks: + rank, as
    vLLM offsets; an external rank of `launch` is not offset: it has ports of its own);
  - binds the publisher on that address: vLLM binds a PUB endpoint only when it holds a
    wildcard and connects otherwise (`ZmqEventPublisher._is_bind_endpoint`), so the plugin
    treats endpoints on `host` as binds (engine/patches/kv_events_bind.py,
    ASCENDSERVE_KV_EVENTS_BIND) instead of exposing them on every interface;
  - turns on vLLM's `--enable-prompt-tokens-details` (each answer's `cached_tokens`, the
    routing's actual hit) unless the user did, and says so (`details_added`): the proxy sets
    the field back to vLLM's null for clients;
  - says at GET /cache_info and in its registration where the events are and how its blocks
    are hashed (the hash algorithm, the seed of the first block and the block size the user set).
"""

from __future__ import annotations

import ipaddress
import os

import msgspec

from ascendserve.config import Config, ConfigError
from ascendserve.flags import argv_value
from ascendserve.protocol.kv_events import CacheInfo

BIND_ENV = "ASCENDSERVE_KV_EVENTS_BIND"
NO_OFFSET_ENV = "ASCENDSERVE_KV_EVENTS_NO_OFFSET"
INFO_ENV = "ASCENDSERVE_CACHE_INFO"
CRYPTO_ALGOS = ("sha256", "sha256_cbor")
ALGOS = (*CRYPTO_ALGOS, "xxhash", "xxhash_cbor")


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def enabled(config: Config, user_args: list[str]) -> bool:
    """Whether this instance publishes: on, and prefix caching not turned off by the user."""
    return bool(config.kv_events.enabled) and not _has(user_args, "--no-enable-prefix-caching") \
        and config.role != "encoder"


def _tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def _ranks(config: Config) -> list[int]:
    """The port offsets of the publishers behind this server: vLLM's internal DP ranks each add
    their rank; an external rank (`launch`) has a server and ports of its own, and the plugin
    keeps vLLM from offsetting them again (NO_OFFSET_ENV: vLLM 0.32 offsets an external rank by
    an index that is not its rank, which put rank 1's publisher on rank 0's replay port)."""
    e = config.engine
    return list(range(e.data_parallel_size)) if e.data_parallel_rank is None else [0]


def events_args(config: Config, user_args: list[str]) -> list[str]:
    """vLLM arguments for the events (none when off)."""
    if not enabled(config, user_args):
        return []
    ev = config.kv_events
    if ":" in ev.host:
        raise ConfigError(f"kv_events.host = {ev.host!r}: an IPv4 address or a host name (vLLM's publisher "
                          "binds IPv6 only on wildcards)")
    settings = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": _tcp(ev.host, ev.port),
                "replay_endpoint": _tcp(ev.host, ev.replay_port), "buffer_steps": ev.buffer_steps, "topic": ""}
    args = ["--kv-events-config", msgspec.json.encode(settings).decode()]
    if not _has(user_args, "--enable-prompt-tokens-details"):
        args.append("--enable-prompt-tokens-details")
    return args


def cache_info(config: Config, user_args: list[str], environ=os.environ) -> CacheInfo | None:
    if not enabled(config, user_args):
        return None
    ev = config.kv_events
    algo = argv_value(user_args, "--prefix-caching-hash-algo") or "sha256"
    seed = environ.get("PYTHONHASHSEED")
    if seed is None and algo in CRYPTO_ALGOS:
        seed = "vllm-none-hash"  # vLLM's fixed seed of cryptographic hashes (kv_cache_utils.init_none_hash)
    elif algo not in CRYPTO_ALGOS:
        seed = None  # xxhash: a random seed per process, or a secret one: never announced
    ranks = _ranks(config)  # vLLM adds the rank to both ports
    host = advertised(ev.host, config)
    block = argv_value(user_args, "--block-size")
    unit = argv_value(user_args, "--prefix-match-unit")
    return CacheInfo(endpoints=[_tcp(host, ev.port + r) for r in ranks],
                     replay=[_tcp(host, ev.replay_port + r) for r in ranks],
                     hash_algo=algo, hash_seed=seed, block_size=int(block) if block and block.isdigit() else 0,
                     hash_block_size=int(unit) if unit and unit.isdigit() else 0,
                     details_added=not _has(user_args, "--enable-prompt-tokens-details"))


def advertised(host: str, config: Config) -> str:
    """How peers reach `host`: itself, or the instance's advertised host for a wildcard."""
    return config.cluster.advertise_host if host in ("0.0.0.0", "") else host


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def events_env(config: Config, user_args: list[str]) -> dict[str, str]:
    info = cache_info(config, user_args)
    if info is None:
        return {}
    return {BIND_ENV: config.kv_events.host, INFO_ENV: msgspec.json.encode(info).decode(),
            **({NO_OFFSET_ENV: "1"} if config.engine.data_parallel_rank is not None else {})}


def registration(config: Config, user_args: list[str]) -> dict:
    info = cache_info(config, user_args)
    return {} if info is None else {"cache": msgspec.to_builtins(info)}
