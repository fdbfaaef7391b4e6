"""engine/patches/compile_cache.py against the vLLM and torch installed here.

vLLM's loader of its compile cache (`compilation.decorators._try_load_aot_compiled_fn`) is given
a function compiled by stock Inductor and saved by torch's AOT path, as a tuning-free engine's
model is on vLLM's CPU platform: without the fix it refuses it (and the engine compiles again),
with it the loaded function computes what the original does. That a restarted engine loads its
model this way: tests/integration/test_defaults.py.
"""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from ascendserve.engine.patches import compile_cache  # noqa: E402


def _layer(x, w):
    return torch.relu(x @ w) + 1


@pytest.fixture
def bundled():
    """torch's bundled Inductor callable as torch ships it, restored as it was after the test."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as cls

    before = cls.__dict__.get("finalize_loading")  # the fix, where this process applied it already
    if before is not None:
        delattr(cls, "finalize_loading")
    yield cls
    if "finalize_loading" in cls.__dict__:
        delattr(cls, "finalize_loading")
    if before is not None:
        cls.finalize_loading = before


def test_vllm_loads_a_function_stock_inductor_compiled_only_with_the_fix(bundled, tmp_path, monkeypatch):
    from vllm.compilation import decorators
    from vllm.config import VllmConfig

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    compiled = torch.compile(_layer, fullgraph=True, backend="inductor").aot_compile(((x, w), {}))
    path = str(tmp_path / "model")
    compiled.save_compiled_function(path)
    config = VllmConfig()
    # what vLLM's loader reads of the model it loads for (its config, its forward's globals)
    model = types.SimpleNamespace(vllm_config=config, compilation_config=config.compilation_config,
                                  _is_encoder=False, _compile_tag="test", forward=_layer)

    assert decorators._try_load_aot_compiled_fn(model, path) is None  # vLLM as shipped: compile again
    assert compile_cache.apply() and "finalize_loading" in bundled.__dict__
    loaded = decorators._try_load_aot_compiled_fn(model, path)
    assert loaded is not None
    assert type(loaded._artifacts.compiled_fn) is bundled
    assert torch.allclose(loaded(x, w), _layer(x, w))
    assert compile_cache.apply() == []  # idempotent


def test_left_alone_where_the_loader_or_the_class_needs_nothing():
    class Bundled:
        pass

    class WithItsOwn:
        def finalize_loading(self, vllm_config):
            return "torch's"

    def finalizing_loader(model, path):
        model.compiled_fn.finalize_loading(None)

    def plain_loader(model, path):
        return model

    finalizing = types.SimpleNamespace(_try_load_aot_compiled_fn=finalizing_loader)
    plain = types.SimpleNamespace(_try_load_aot_compiled_fn=plain_loader)
    assert compile_cache.apply(plain, Bundled) == [] and "finalize_loading" not in Bundled.__dict__
    assert compile_cache.apply(finalizing, WithItsOwn) == []
    assert WithItsOwn().finalize_loading(None) == "torch's"
    assert compile_cache.apply(finalizing, Bundled) and Bundled().finalize_loading(None) is None
    with pytest.raises(TypeError):  # a vLLM without that loader: the check does not fit, say so
        compile_cache.apply(types.SimpleNamespace(), type("Other", (), {}))
