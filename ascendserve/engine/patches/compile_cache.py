"""vLLM's compile cache, loaded instead of recompiled, where the model was compiled by stock Inductor.

An engine started without --enforce-eager compiles its model with torch.compile and saves the
result under ~/.cache/vllm/torch_compile_cache/torch_aot_compile/<hash> (VLLM_USE_AOT_COMPILE),
so that the next start with the same configuration loads it. On vLLM's CPU platform the model is
compiled in DYNAMO_TRACE_ONCE mode by torch's own Inductor backend, and torch 2.13 saves what that
backend returns as a `BundledAOTAutogradSerializableCallable`. vLLM 0.32's loader
(`compilation.decorators._try_load_aot_compiled_fn`) then calls `finalize_loading(vllm_config)` on
every loaded function, a method only vLLM's own `VllmSerializableFunction` has: the load fails
("'function' object has no attribute 'finalize_loading'", logged as "Compiling model again due
to a load failure"), and the engine compiles again from scratch, at every start. Measured on a
2-core host: 50-145 s of a tuning-free engine's start, each time it starts or is restarted.

A function compiled by stock Inductor has nothing to finalize (its Inductor artifacts are
loaded when it is deserialized), so the fix gives that class a `finalize_loading` that does
nothing; vLLM's own functions keep theirs.

Decided by the code: installed when vLLM's loader calls `finalize_loading` and torch's bundled
callable has no such method. Any platform (vLLM's GPU default compiles through its own backend,
but any mode that hands the model to stock Inductor meets the same loader).

One compile per host (`apply_lock`): engines of one host that start together with the same
configuration (`--role all`'s prefill and decode, a supervisor's replicas, a test runner's
workers) found the cache empty at once and each compiled the same model, side by side on the
same cores (P and D of a cold 1P1D took 133 s each on a 2-core host). The loader now takes an
exclusive flock next to the cache entry before it looks: the first engine finds nothing,
compiles, and lets go once vLLM saved the result; the others wait on the flock and then load
it. A warm cache costs an uncontended flock. The flock goes with its process (a compile that
crashes frees it), and a waiter gives up after ASCENDSERVE_COMPILE_LOCK_WAIT_S (300 s by
default; 0 turns the lock off) and compiles by itself, as vLLM does.
"""

from __future__ import annotations

import fcntl
import os
import time

PATCHED = "_ascendserve_fix"
LOCK_WAIT_ENV = "ASCENDSERVE_COMPILE_LOCK_WAIT_S"
DEFAULT_LOCK_WAIT_S = 300.0


def _nothing_to_finalize(self, vllm_config=None) -> None:
    """Stock Inductor's artifacts are loaded with the function itself."""


setattr(_nothing_to_finalize, PATCHED, True)


def loader_finalizes(decorators=None) -> bool:
    """Whether vLLM's AOT loader calls `finalize_loading` on what it loaded."""
    if decorators is None:
        from vllm.compilation import decorators
    load = getattr(decorators, "_try_load_aot_compiled_fn", None)
    load = getattr(load, "__wrapped__", load)  # under apply_lock's wrapper
    code = getattr(load, "__code__", None)
    if code is None:
        raise TypeError("vllm.compilation.decorators has no _try_load_aot_compiled_fn")
    return "finalize_loading" in code.co_names


def apply(decorators=None, bundled=None) -> list[str]:
    """Give torch's bundled Inductor callable a no-op `finalize_loading` where vLLM's loader
    calls it and the class lacks it. Idempotent; returns what was installed."""
    if bundled is None:
        from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as bundled
    current = bundled.__dict__.get("finalize_loading")
    if current is not None:
        return []  # ours already, or a torch that has one of its own
    if not loader_finalizes(decorators):
        return []  # a vLLM whose loader no longer needs it
    bundled.finalize_loading = _nothing_to_finalize
    return [f"{bundled.__name__}.finalize_loading (vLLM's compile cache loads instead of recompiling)"]


def _lock_wait_s() -> float:
    raw = os.environ.get(LOCK_WAIT_ENV, "")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_LOCK_WAIT_S
    except ValueError:
        raise ValueError(f"{LOCK_WAIT_ENV}={raw!r}: expected seconds (0 turns the compile lock off)") from None


def _acquire(path: str, wait_s: float, log) -> int | None:
    """An exclusive flock on `path`, waited for up to wait_s; None past it (or where the cache
    directory cannot hold a lock file), and the caller goes on unlocked, as vLLM would."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        log.warning("compile lock unavailable; compiling without it", path=path, error=str(exc))
        return None
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if waited:
                log.info("another process of this host compiled the model; loading what it saved", path=path)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                log.warning("another process of this host is still compiling the model; compiling it here too",
                            path=path, waited_s=round(wait_s))
                os.close(fd)
                return None
            if not waited:
                log.info("another process of this host is compiling the same model; waiting to load it",
                         path=path, up_to_s=round(wait_s))
                waited = True
            time.sleep(0.25)


def _release(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def apply_lock(decorators=None) -> list[str]:
    """Wrap vLLM's compile-cache loader in a per-entry host lock (see the module's doc):
    a miss keeps the lock until vLLM saved what it then compiled. Idempotent."""
    if decorators is None:
        from vllm.compilation import decorators
    load = getattr(decorators, "_try_load_aot_compiled_fn", None)
    if load is None:
        raise TypeError("vllm.compilation.decorators has no _try_load_aot_compiled_fn")
    if getattr(load, PATCHED, False):
        return []
    if _lock_wait_s() == 0:
        return []

    from ascendserve.logging import get_logger

    log = get_logger("ascendserve.patches")

    def locked_load(model, aot_compilation_path):
        compiles = getattr(getattr(model, "compilation_config", None), "backend", "") != "eager"
        save = getattr(model, "save_aot_compiled_function", None)
        fd = _acquire(aot_compilation_path + ".lock", _lock_wait_s(), log) if compiles and save else None
        try:
            loaded = load(model, aot_compilation_path)
        except BaseException:
            if fd is not None:
                _release(fd)
            raise
        if fd is None:
            return loaded
        if loaded is not None:
            _release(fd)
            return loaded

        # this process compiles next: others wait until vLLM saved it (the call that follows the
        # compile; an instance attribute shadows the class's method for this model only)
        own = model.__dict__.get("save_aot_compiled_function")

        def save_then_release():
            try:
                return save()
            finally:
                if own is None:
                    model.__dict__.pop("save_aot_compiled_function", None)
                else:
                    model.__dict__["save_aot_compiled_function"] = own
                _release(fd)

        model.__dict__["save_aot_compiled_function"] = save_then_release
        return None

    locked_load.__wrapped__ = load
    setattr(locked_load, PATCHED, True)
    decorators._try_load_aot_compiled_fn = locked_load
    return ["vLLM's compile cache: one compile per host for engines that start together"]
