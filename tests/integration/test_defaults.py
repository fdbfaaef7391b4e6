"""Engines started the way a new user starts them: their own model directory and no tuning flag.

No --dtype, no --enforce-eager (vLLM compiles), no memory setting in flags or in the
environment: on a CPU host the engine roles size their KV cache from free memory and
pick a dtype the CPU runs. The oracle is plain vLLM with vLLM's own defaults (it gets
only a KV size, without which vLLM cannot start beside other engines here). Every
topology gets the traffic users send: repeats, shared prefixes, chat, streams.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ascendserve.launch.children import kill_group
from tests.conftest import host_copy
from tests.procs import ENGINE_ENV, UNTUNED_ENV, all_role_port, ascendserve, completion_ids, start_all
from tests.traffic import BF16_TIE_NATS, check_user_traffic

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def user_model(text_model) -> Path:
    """A model of the user's own: a directory of theirs, not the demo the `all` role makes itself.
    It holds the suite's tiny text model, so that the session's untuned plain vLLM on that model
    is its oracle (one engine start less than an oracle of its own). It stays where it is between
    sessions, as a user's model does: vLLM's compile cache is keyed by the model's path, so an
    engine here loads what an earlier start compiled (a path of its own each session compiled
    every engine of this module from scratch, ~1 CPU-minute each)."""
    return host_copy(text_model, "my-model")


RECOMPILED = "Compiling model again"  # vLLM could not load its compile cache (engine/patches/compile_cache.py)


def loaded_from_cache(text: str) -> bool:
    return "Directly load AOT compilation" in text


def check(url: str, oracle, user_model: Path, text_model: Path) -> int:
    """Users' traffic to `url`, compared with the oracle: plain vLLM with vLLM's defaults on the same
    weights (untuned_text_oracle), which serves them under the suite's model directory's name."""
    return check_user_traffic(url, oracle.url, str(user_model), tie_nats=BF16_TIE_NATS,
                              oracle_model=str(text_model))


def test_pd_role_with_no_flags_serves_users(user_model, text_model, untuned_text_oracle, tmp_path):
    pd = ascendserve("pd", user_model, tmp_path, tuned=False)
    start_all(pd)
    try:
        argv = next(json.loads(line)["vllm_args"] for line in pd.log_text().splitlines()
                    if '"starting vLLM"' in line)
        assert "--enforce-eager" not in argv and "--kv-cache-memory-bytes" in argv
        check(pd.url, untuned_text_oracle, user_model, text_model)
        # restarted (a crash, an upgrade of the host), it loads the model it compiled, whether
        # this start compiled it or found it in the cache; and it answers as before
        first = pd.log_text()
        assert RECOMPILED not in first, first[-4000:]
        prompt = "A restarted engine answers"
        before = completion_ids(pd.url, str(user_model), prompt)
        pd.stop()
        start_all(pd)
        again = pd.log_text()[len(first):]
        assert loaded_from_cache(again) and RECOMPILED not in again, again[-4000:]
        assert completion_ids(pd.url, str(user_model), prompt) == before
    finally:
        pd.stop()


def _start_all_role(model: Path, run_dir: Path, *flags: str):
    port = all_role_port()
    out = open(run_dir / "all.out", "w")
    env = {k: v for k, v in {**os.environ, **ENGINE_ENV, **UNTUNED_ENV}.items() if v is not None}
    proc = subprocess.Popen([sys.executable, "-m", "ascendserve", "--role", "all", "--topology", "1P1D",
                             "--model", str(model), "--port", str(port), "--runtime-dir", str(run_dir / "run"),
                             "--log-format", "json", *flags],
                            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", run_dir / "all.out"


def _wait_ready(proc, log: Path, timeout: float = 420) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"`all` exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        if "ready at" in log.read_text(errors="replace"):
            return
        time.sleep(1)
    raise AssertionError(f"`all` never announced itself:\n{log.read_text()[-4000:]}")


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    finally:
        kill_group(proc.pid, grace_s=0.0)


def _events(log: Path, name: str) -> list[dict]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        if f'"{name}"' in line and line.startswith("{"):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == name:
                found.append(event)
    return found


# tests/memory.py: `all` starts its P and D without tests.procs; untuned, each refuses to start
# unless ENGINE_OVERHEAD_BYTES (3 GiB) plus a KV cache is free (CI: 4.0 reserved, 5.55 GiB free)
@pytest.mark.memory_gib(6.5)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_all_1p1d_with_a_users_model_and_no_flags(user_model, text_model, untuned_text_oracle, tmp_path, mode):
    proc, url, log = _start_all_role(user_model, tmp_path, *(["--mode", "push"] if mode == "push" else []))
    try:
        _wait_ready(proc, log)
        sent = check(url, untuned_text_oracle, user_model, text_model)
        # every request's KV came over from P: nothing stalled into a recompute
        received = _events(log, "KV received") if mode == "push" else _events(log, "KV pulled")
        assert len(received) >= sent, f"{len(received)} KV hand-offs for {sent} requests"
        assert not _events(log, "pushed KV never completed; failing the load")
        assert RECOMPILED not in log.read_text(errors="replace")
    finally:
        _stop(proc)
