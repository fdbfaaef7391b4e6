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
"""

from __future__ import annotations

PATCHED = "_ascendserve_fix"


def _nothing_to_finalize(self, vllm_config=None) -> None:
    """Stock Inductor's artifacts are loaded with the function itself."""


setattr(_nothing_to_finalize, PATCHED, True)


def loader_finalizes(decorators=None) -> bool:
    """Whether vLLM's AOT loader calls `finalize_loading` on what it loaded."""
    if decorators is None:
        from vllm.compilation import decorators
    load = getattr(decorators, "_try_load_aot_compiled_fn", None)
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
