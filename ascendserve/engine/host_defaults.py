"""Engine settings that a CPU host needs and a user should not have to know.

vLLM's CPU backend reserves `gpu_memory_utilization` (0.92) of the host's RAM and
refuses to start when that much is not free, so a second engine, or one engine
beside anything else, never starts with vLLM's defaults; and a bfloat16 model
dies with SIGILL on a CPU without native bf16. On a CPU host an engine role
therefore gets, unless a setting says otherwise:

- dtype float32 when the CPU has no bf16 instructions (engine.dtype = "auto");
- an explicit KV cache (vLLM's --kv-cache-memory-bytes) sized from what the
  model needs (16 sequences of max_model_len tokens) and what the host has free,
  shared by the `engine.host_engines` engines starting on it (`all` sets that);
- ASCENDSERVE_SHM_NAP_MS: vLLM's idle shared-memory readers nap instead of
  spinning a core each for a second after every step
  (engine/patches/idle_poll.py). The spin saves microseconds a step on a GPU;
  on a CPU host it takes the cores that the host's other engine processes (or
  this engine's own API server) need: measured here, three engines on two
  cores served a mixed load in 4.7 s instead of 9.8 s, worst request 0.29 s
  instead of 2.4 s; an engine alone keeps its median. Every CPU host gets it,
  not only those where `host_engines` says several engines share the cores:
  engines started by hand, each unaware of the others, starved each other;
- ASCENDSERVE_ENGINE_CORE_START=fork: vLLM's engine core is forked from the API
  server instead of spawned, so it does not import torch and vLLM a second
  time (engine/patches/core_fork.py; measured here: ready in 18-22 s instead
  of 30 s).
- ASCENDSERVE_WORKER_START=fork: its workers are forked from the engine core
  too, bound to their cores as vLLM would bind a spawned one, and the engine
  role re-executes itself once at its start with the libraries vLLM preloads
  into its workers (engine/patches/worker_fork.py; measured here: ready in ~14 s instead of
  ~24 s with both spawned).

An explicit setting always wins: engine.kv_cache_memory_bytes,
engine.gpu_memory_utilization, VLLM_CPU_KVCACHE_SPACE, ASCENDSERVE_SHM_NAP_MS
(0 keeps vLLM's spin), ASCENDSERVE_ENGINE_CORE_START (spawn keeps vLLM's), or
the same vLLM flags passed through. A start-up that cannot fit fails here, in
one line naming the setting to change, before vLLM starts. No torch or vLLM import: the facts come
from /dev, /proc and the model's config.json.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path

import psutil

from ascendserve.config import Config, ConfigError, environ
from ascendserve.engine.patches import core_fork, idle_poll, worker_fork  # stdlib-only: no vLLM import

GiB = 1 << 30
MiB = 1 << 20
# Resident memory of one vLLM instance on a CPU beside its weights (API server,
# engine core and worker with torch, measured ~3 GB), and the KV the default aims at.
ENGINE_OVERHEAD_BYTES = 3 * GiB
DEFAULT_FULL_SEQUENCES = 16
FREE_SHARE = 0.5  # of what is left after the engines' own memory: the rest stays free
DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "auto": 2}
# Settings that size vLLM's memory themselves; any of them switches the default off.
MEMORY_FLAGS = ("kv-cache-memory-bytes", "gpu-memory-utilization")


def is_cpu_host() -> bool:
    """No accelerator device nodes (CUDA, Ascend): vLLM runs its CPU backend."""
    return not (glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/davinci[0-9]*"))


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


@dataclass(frozen=True)
class ModelFacts:
    layers: int
    kv_elements_per_token: int  # over all layers: K and V, or the MLA latent
    max_positions: int
    weight_bytes: int


def model_facts(model_dir: str) -> ModelFacts | None:
    """What sizing needs from a HuggingFace-style model directory, or None if it cannot tell."""
    path = Path(model_dir)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    get = lambda key, default=None: text.get(key, cfg.get(key, default))  # noqa: E731
    try:
        layers = int(get("num_hidden_layers"))
        heads = int(get("num_attention_heads"))
        if get("kv_lora_rank"):  # MLA: one latent (kv_lora_rank + rope dim) per token and layer
            per_layer = int(get("kv_lora_rank")) + int(get("qk_rope_head_dim", 64))
        else:
            kv_heads = int(get("num_key_value_heads") or heads)
            head_dim = int(get("head_dim") or int(get("hidden_size")) // heads)
            per_layer = 2 * kv_heads * head_dim
        max_positions = int(get("max_position_embeddings", 4096))
    except (TypeError, ValueError, ZeroDivisionError):
        return None
    weights = sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt")
                  for f in path.glob(pattern) if f.is_file())
    return ModelFacts(layers, layers * per_layer, max_positions, weights)


def _passthrough_keys(config: Config) -> set[str]:
    keys = {k.replace("_", "-") for k in config.engine.vllm}
    for arg in config.engine.vllm_args:
        if arg.startswith("--"):
            keys.add(arg[2:].split("=", 1)[0].replace("_", "-"))
    return keys


SHM_NAP_MS = "0.5"  # a waiting reader's nap, after 20 ms without a step: at most that per request
CORE_START = "fork"
WORKER_START = "fork"


def process_env(*, cpu: bool | None = None) -> dict[str, str]:
    """How an engine's processes behave on a CPU host: its idle shared-memory readers nap
    (ASCENDSERVE_SHM_NAP_MS), its engine core and workers are forked
    (ASCENDSERVE_ENGINE_CORE_START, ASCENDSERVE_WORKER_START);
    a variable the user set stays as it is, and accelerator hosts keep vLLM's ways."""
    if not (is_cpu_host() if cpu is None else cpu):
        return {}
    ours = {idle_poll.ENV: SHM_NAP_MS, core_fork.ENV: CORE_START, worker_fork.ENV: WORKER_START}
    mine = environ()
    return {k: v for k, v in ours.items() if k not in mine}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def engine_dtype(config: Config, cpuinfo: str | None = None) -> str:
    """engine.dtype, with "auto" made float32 on a CPU host whose CPU has no bf16 instructions."""
    dtype = config.engine.dtype
    if dtype == "auto" and "dtype" not in _passthrough_keys(config) and is_cpu_host() and not cpu_has_bf16(cpuinfo):
        return "float32"
    return dtype


def memory_args(config: Config, *, dtype: str | None = None, cpu: bool | None = None, available: int | None = None,
                total: int | None = None) -> list[str]:
    """vLLM's memory arguments for this engine role: the explicit ones, or on a CPU host a KV
    cache sized from free memory; a start-up that cannot fit is a ConfigError naming the setting."""
    e = config.engine
    if e.gpu_memory_utilization is not None:
        args = ["--gpu-memory-utilization", str(e.gpu_memory_utilization)]
    else:
        args = []
    if e.kv_cache_memory_bytes is not None:
        return args + ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    if not (is_cpu_host() if cpu is None else cpu):
        return args
    mem = psutil.virtual_memory()
    available = mem.available if available is None else available
    total = mem.total if total is None else total
    if e.gpu_memory_utilization is not None:
        wanted = e.gpu_memory_utilization * total
        if wanted > available:
            raise ConfigError(
                f"engine.gpu_memory_utilization = {e.gpu_memory_utilization} asks vLLM's CPU backend for "
                f"{_gib(wanted)} of RAM but {_gib(available)} of {_gib(total)} is free: lower "
                "engine.gpu_memory_utilization (--gpu-memory-utilization) or unset it (then the KV cache is "
                "sized from free memory)")
        return args
    if environ().get("VLLM_CPU_KVCACHE_SPACE") or _passthrough_keys(config) & set(MEMORY_FLAGS):
        return args
    facts = model_facts(config.model.path)
    if facts is None:
        return args  # not a directory we can read: vLLM says what is wrong with it
    per_token = facts.kv_elements_per_token * DTYPE_BYTES.get(dtype or engine_dtype(config), 2)
    max_len = e.max_model_len or facts.max_positions
    one_sequence = per_token * max_len
    engines = e.host_engines
    need = ENGINE_OVERHEAD_BYTES + facts.weight_bytes
    share = (available - engines * need) * FREE_SHARE / engines
    want = one_sequence * (1 if config.role == "encoder" else DEFAULT_FULL_SEQUENCES)
    kv = int(min(want, share)) // MiB * MiB
    if kv < one_sequence:
        raise ConfigError(
            f"this host cannot fit the engine: {_gib(available)} of RAM is free for {engines} engine(s), each "
            f"needing about {_gib(need)} plus a KV cache of at least {_gib(one_sequence)} for one {max_len}-token "
            "sequence; lower engine.max_model_len (--max-model-len), set engine.kv_cache_memory_bytes "
            "(--kv-cache-memory-bytes), or free memory")
    return args + ["--kv-cache-memory-bytes", str(kv)]
