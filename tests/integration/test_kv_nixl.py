"""vLLM's NixlConnector behind our roles and proxy (`--kv-connector nixl`), real engines:
NIXL 1.5.1 over UCX's tcp transport with host-memory KV buffers (kv_buffer_device cpu), as a
user of a CPU host runs it.

Checks the oracle (greedy ids equal plain vLLM's, streamed and not, from 1 token to thousands,
16 at once), users' traffic (repeats within 2x their first run, shared prefixes, chat and
streams), every request's KV read from P by NIXL and not recomputed (D computes one prompt
token per request at most: vllm:prompt_tokens_by_source_total; NIXL reads counted by
vllm:nixl_xfer_time_seconds_count), P's and D's blocks back to idle after D read them; a
cluster started with no tuning flag at all; and that our pull P and a nixl D are never paired.
"""

from __future__ import annotations

import importlib.util
import json
import re

import httpx
import pytest

from tests.procs import ascendserve, completion_ids, concurrent_ids, control, kv_usage, start_all, wait_for
from tests.traffic import BF16_TIE_NATS, LENGTHS, assert_greedy, check_user_traffic, completion, completion_body

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None,
                                 reason="nixl not installed (scripts/install.sh installs nixl==1.5.1)")]
TOKEN = "nixl-test-token"
MAX_TOKENS = 16
NIXL = ("--kv-connector", "nixl", "--cluster-token", TOKEN)
_XFERS = re.compile(r"^vllm:nixl_xfer_time_seconds_count\{[^}]*\}\s+([0-9.eE+-]+)", re.MULTILINE)
_COMPUTED = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="local_compute"[^}]*\}\s+([0-9.eE+-]+)',
                       re.MULTILINE)


def xfers(decode) -> int:
    """NIXL reads D finished (vLLM's own counter)."""
    found = _XFERS.search(httpx.get(decode.url + "/metrics", timeout=10).text)
    return int(float(found.group(1))) if found else 0


def computed(decode) -> int:
    """Prompt tokens D computed itself (vLLM's counter): with the KV read from P, one per
    request at most (the last prompt token; D's own prefix cache and NIXL supply the rest),
    thousands for a request that fell back to recomputing its prompt."""
    found = _COMPUTED.search(httpx.get(decode.url + "/metrics", timeout=10).text)
    assert found, "vLLM exports no vllm:prompt_tokens_by_source_total"
    return int(float(found.group(1)))


class Read:
    """Counts across a block of requests: every one read through NIXL, none recomputed."""

    def __init__(self, decode):
        self.decode, self.xfers, self.computed = decode, xfers(decode), computed(decode)

    def check(self, requests: int) -> None:
        assert computed(self.decode) - self.computed <= requests, \
            f"D computed {computed(self.decode) - self.computed} prompt tokens for {requests} requests: recomputed"
        assert xfers(self.decode) > self.xfers, "D read nothing through NIXL"


def nixl_cluster(model, logs, tuned: bool = True, name: str = ""):
    prefill = ascendserve("prefill", model, logs, *NIXL, name=f"prefill{name}", tuned=tuned)
    decode = ascendserve("decode", model, logs, *NIXL, name=f"decode{name}", tuned=tuned)
    start_all(prefill, decode)
    proxy = control("proxy", logs, "--prefill", f"127.0.0.1:{prefill.port}", "--decode", f"127.0.0.1:{decode.port}",
                    "--cluster-token", TOKEN)
    start_all(proxy)
    wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 60, "proxy never healthy")
    return prefill, decode, proxy


def idle(*procs) -> None:
    wait_for(lambda: all(kv_usage(p) == 0.0 for p in procs), 30, "KV blocks still allocated after D read them")


def test_untuned_nixl_serves_user_traffic(text_model, untuned_text_oracle, tmp_path):
    """P and D started as a user starts them: the connector and nothing else."""
    procs = []
    try:
        prefill, decode, proxy = nixl_cluster(text_model, tmp_path, tuned=False, name="-untuned")
        procs = [prefill, decode, proxy]
        argv = next(json.loads(line)["vllm_args"] for line in prefill.log_text().splitlines()
                    if '"starting vLLM"' in line)
        assert "--enforce-eager" not in argv
        read = Read(decode)
        sent = check_user_traffic(proxy.url, untuned_text_oracle.url, str(text_model), seed=21,
                                  tie_nats=BF16_TIE_NATS)
        read.check(sent)
        idle(prefill, decode)
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def cluster(text_model, text_oracle, tmp_path_factory):
    prefill, decode, proxy = nixl_cluster(text_model, tmp_path_factory.mktemp("kv-nixl"))
    yield {"oracle": text_oracle, "prefill": prefill, "decode": decode, "proxy": proxy, "model": str(text_model)}
    for p in (proxy, prefill, decode):
        p.stop()


@pytest.mark.parametrize("prompt", list(LENGTHS.values()), ids=list(LENGTHS))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_nixl_equals_plain_vllm(cluster, prompt, stream):
    c = cluster
    expected, _ = completion(c["oracle"].url, c["model"], prompt, MAX_TOKENS)
    read = Read(c["decode"])
    ours, _ = completion(c["proxy"].url, c["model"], prompt, MAX_TOKENS, stream=stream)
    assert_greedy(ours, expected, c["oracle"].url, completion_body(c["model"], prompt, MAX_TOKENS), "nixl 1P1D")
    if len(prompt) > 1:  # a 1-token prompt leaves D nothing to read: it computes that token itself
        read.check(1)


def test_16_at_once_then_blocks_back_to_idle(cluster):
    c = cluster
    prompts = [f"Request {i}: a story about the number {i * 7} and the colour of the sky. " * (1 + i % 6)
               for i in range(16)]
    expected = [completion_ids(c["oracle"].url, c["model"], p, MAX_TOKENS) for p in prompts]
    read = Read(c["decode"])
    assert concurrent_ids(c["proxy"].url, c["model"], prompts, MAX_TOKENS) == expected
    read.check(16)
    idle(c["prefill"], c["decode"])  # P released every block once D had read it


def test_users_traffic(cluster):
    c = cluster
    read = Read(c["decode"])
    sent = check_user_traffic(c["proxy"].url, c["oracle"].url, c["model"], seed=17)
    read.check(sent)
    idle(c["prefill"], c["decode"])


def test_our_pull_prefill_and_a_nixl_decode_are_refused_as_a_mismatch(cluster, text_model, tmp_path):
    c = cluster
    ours = ascendserve("prefill", text_model, tmp_path, "--kv-connector", "pull", "--cluster-token", TOKEN,
                       name="prefill-pull")
    procs = [ours]
    try:
        start_all(ours)
        proxy = control("proxy", tmp_path, "--prefill", f"127.0.0.1:{ours.port}",
                        "--decode", f"127.0.0.1:{c['decode'].port}", "--cluster-token", TOKEN)
        procs.append(proxy)
        start_all(proxy)
        wait_for(lambda: httpx.get(proxy.url + "/health").status_code == 200, 60, "proxy never healthy")
        before = xfers(c["decode"])
        r = httpx.post(proxy.url + "/v1/completions", json=completion_body(c["model"], "hello there", 4), timeout=60)
        assert r.status_code == 503, r.text
        assert "prefill runs pull, decode runs nixl" in r.json()["error"]["message"]
        assert any("KV connectors of prefill and decode differ" in line for line in proxy.log_text().splitlines())
        assert xfers(c["decode"]) == before
    finally:
        for p in reversed(procs):
            p.stop()
