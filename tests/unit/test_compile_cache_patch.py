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


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """One Inductor cache for the module's compiles of _layer: the C++ kernel is built once (about
    25 s here) and the later compiles hit its cache. What the tests check is vLLM's own cache of
    the compiled function (the path each test saves to), which stays per test."""
    return str(tmp_path_factory.mktemp("inductor"))


def test_vllm_loads_a_function_stock_inductor_compiled_only_with_the_fix(bundled, inductor_cache, tmp_path,
                                                                         monkeypatch):
    from vllm.compilation import decorators
    from vllm.config import VllmConfig

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
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


def test_engines_that_start_together_compile_once_and_the_others_load(bundled, inductor_cache, tmp_path,
                                                                      monkeypatch):
    """compile_cache.apply_lock around vLLM's own loader: of two engines (threads here: a flock
    is per open file, so they contend as processes do) that find the same entry empty at once,
    the first compiles and saves while the second waits, then loads what the first saved.
    Without the lock the second also finds nothing and compiles."""
    import threading
    import time

    from vllm.compilation import decorators
    from vllm.config import VllmConfig

    assert compile_cache.apply()  # the loader can load stock Inductor's functions at all
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache)
    monkeypatch.setattr(decorators, "_try_load_aot_compiled_fn", decorators._try_load_aot_compiled_fn)
    assert compile_cache.apply_lock() and compile_cache.apply_lock() == []  # idempotent
    assert compile_cache.loader_finalizes()  # its check still reads vLLM's loader under the wrapper
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    path = str(tmp_path / "cache" / "rank_0_0" / "model")
    config = VllmConfig()
    events: list[str] = []
    compiling = threading.Event()

    def engine(name: str) -> None:
        def save():  # vLLM saves right after it compiled (save_aot_compiled_function)
            time.sleep(2.0)  # a compile that takes a while
            compiled = torch.compile(_layer, fullgraph=True, backend="inductor").aot_compile(((x, w), {}))
            compiled.save_compiled_function(path)
            events.append(f"{name} saved")

        model = types.SimpleNamespace(vllm_config=config, compilation_config=config.compilation_config,
                                      _is_encoder=False, _compile_tag="test", forward=_layer,
                                      save_aot_compiled_function=save)
        loaded = decorators._try_load_aot_compiled_fn(model, path)
        if loaded is None:
            events.append(f"{name} compiles")
            compiling.set()
            model.save_aot_compiled_function()
            assert model.save_aot_compiled_function is save  # the wrapper went with the lock
        else:
            events.append(f"{name} loaded")
            assert torch.allclose(loaded(x, w), _layer(x, w))

    first = threading.Thread(target=engine, args=("first",))
    first.start()
    assert compiling.wait(60)
    second = threading.Thread(target=engine, args=("second",))
    second.start()
    first.join(120)
    second.join(120)
    assert events == ["first compiles", "first saved", "second loaded"]
    # a warm cache: the lock is free and the loader loads at once
    started = time.monotonic()
    engine("third")
    assert events[-1] == "third loaded" and time.monotonic() - started < 30


def test_the_compile_lock_gives_up_after_its_wait(tmp_path, monkeypatch):
    """A waiter whose compiler never finishes compiles by itself past ASCENDSERVE_COMPILE_LOCK_WAIT_S."""
    import fcntl
    import time

    calls = []

    def loader(model, path):
        calls.append(path)
        return None

    fake = types.SimpleNamespace(_try_load_aot_compiled_fn=loader)
    monkeypatch.setenv(compile_cache.LOCK_WAIT_ENV, "1")
    assert compile_cache.apply_lock(fake)
    path = str(tmp_path / "model")
    holder = open(path + ".lock", "w")
    fcntl.flock(holder, fcntl.LOCK_EX)
    def save():
        pass

    model = types.SimpleNamespace(compilation_config=types.SimpleNamespace(backend="inductor"),
                                  save_aot_compiled_function=save)
    started = time.monotonic()
    assert fake._try_load_aot_compiled_fn(model, path) is None and calls == [path]
    assert 1 <= time.monotonic() - started < 10
    assert model.save_aot_compiled_function is save  # unlocked: nothing to release after the save
    holder.close()
    monkeypatch.setenv(compile_cache.LOCK_WAIT_ENV, "0")  # off: vLLM's loader as it is
    assert compile_cache.apply_lock(types.SimpleNamespace(_try_load_aot_compiled_fn=loader)) == []
    monkeypatch.setenv(compile_cache.LOCK_WAIT_ENV, "soon")
    with pytest.raises(ValueError, match="ASCENDSERVE_COMPILE_LOCK_WAIT_S"):
        compile_cache.apply_lock(types.SimpleNamespace(_try_load_aot_compiled_fn=loader))
