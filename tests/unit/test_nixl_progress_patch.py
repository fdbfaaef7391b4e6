"""engine/patches/nixl_progress.py: NIXL's progress thread sleeps until an event instead of
spinning a core (nixl 1.5.1 hard-codes its delay to 0)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import types

import pytest

from ascendserve.engine.patches import nixl_progress


def fake_api():
    made = []

    class Config:
        def __init__(self):
            self.pthrDelay, self.useProgThread = 0, True

    binding = types.ModuleType("fake_bindings")
    binding.nixlAgentConfig = Config
    binding.nixlAgent = lambda name, config: made.append((name, config.pthrDelay)) or name
    binding.other = "kept"
    api = types.SimpleNamespace(nixlBind=binding)
    return api, Config, made


def test_agents_get_the_delay_where_nixl_left_zero():
    api, Config, made = fake_api()
    assert nixl_progress.apply(api, {nixl_progress.ENV: "1000"}) == ["nixl_progress"]
    api.nixlBind.nixlAgent("a", Config())
    explicit = Config()
    explicit.pthrDelay = 50
    api.nixlBind.nixlAgent("b", explicit)
    no_thread = Config()
    no_thread.useProgThread = False
    api.nixlBind.nixlAgent("c", no_thread)
    assert made == [("a", 1000), ("b", 50), ("c", 0)]
    assert api.nixlBind.other == "kept" and api.nixlBind.nixlAgentConfig is Config
    assert nixl_progress.apply(api, {nixl_progress.ENV: "1000"}) == []  # once


def test_nothing_unless_asked_and_a_nixl_without_the_setting_is_left_alone():
    api, _, _ = fake_api()
    binding = api.nixlBind
    assert nixl_progress.apply(api, {}) == [] and nixl_progress.apply(api, {nixl_progress.ENV: "0"}) == []
    assert api.nixlBind is binding
    binding.nixlAgentConfig = lambda: types.SimpleNamespace(useProgThread=True)  # no pthrDelay
    with pytest.raises(AttributeError):
        nixl_progress.apply(api, {nixl_progress.ENV: "1000"})
    assert api.nixlBind is binding
    with pytest.raises(ValueError, match="microseconds"):
        nixl_progress.apply(api, {nixl_progress.ENV: "fast"})


SPIN = textwrap.dedent("""
    import os, sys, time
    if sys.argv[1] == "patched":
        from ascendserve.engine.patches import nixl_progress
        assert nixl_progress.apply(environ={nixl_progress.ENV: "1000"}) == ["nixl_progress"]
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("probe", nixl_agent_config(num_threads=4))
    time.sleep(0.5)
    start = time.process_time()
    time.sleep(2.0)
    print(time.process_time() - start, flush=True)
    os._exit(0)  # nixl 1.5.1's agent crashes the interpreter's exit (SIGSEGV), patched or not
""")


@pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl not installed")
def test_an_idle_nixl_agent_no_longer_spins_a_core():
    """The real NIXL: an idle agent's process uses ~2 CPU-s in 2 s as shipped, ~0 patched."""
    def cpu_seconds(mode):
        out = subprocess.run([sys.executable, "-c", SPIN, mode], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.strip().splitlines()[-1])

    assert cpu_seconds("patched") < 0.5
    assert cpu_seconds("plain") > 1.0  # what the patch is for; if NIXL stops spinning, drop the patch
