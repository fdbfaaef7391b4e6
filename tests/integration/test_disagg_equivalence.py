"""Correctness oracle: greedy token ids through 1P1D and 1E1PD equal plain vLLM's.

Each topology runs with vLLM's example connectors (shared filesystem); the
tests also prove the hand-off really happened (files written by the
producer, the consumer's log saying it loaded them), so a consumer that
silently recomputed everything could not pass.
"""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import pytest

from tests.procs import ascendserve, plain_vllm, start_all

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
PROMPTS = [
    "The history of the lighthouse keeper begins on a small rocky island. " * 3,
    "In a quiet village at the edge of the forest, the old clockmaker repaired "
    "everything from pocket watches to the great tower bell. " * 4,
    "".join(f"Step {i}: add {i} to the running total and write it down. " for i in range(1, 15)),
]


def completion_ids(url: str, model: str, prompt: str, max_tokens: int) -> list[int]:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "return_token_ids": True,
    })
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def chat_ids(url: str, model: str, messages: list, max_tokens: int) -> list[int]:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, "return_token_ids": True,
    })
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def text_cluster(text_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("p1d1-logs")
    kv = tmp_path_factory.mktemp("kv-store")
    oracle = plain_vllm(text_model, logs)
    prefill = ascendserve("prefill", text_model, logs, "--kv-path", str(kv))
    decode = ascendserve("decode", text_model, logs, "--kv-path", str(kv))
    start_all(oracle, prefill, decode)
    yield oracle, prefill, decode, kv
    for p in (oracle, prefill, decode):
        p.stop()


def test_1p1d_equals_plain_vllm(text_cluster, text_model):
    oracle, prefill, decode, kv = text_cluster
    model = str(text_model)
    for i, prompt in enumerate(PROMPTS, start=1):
        expected = completion_ids(oracle.url, model, prompt, MAX_TOKENS)
        assert len(expected) == MAX_TOKENS and len(set(expected)) > 4
        first = completion_ids(prefill.url, model, prompt, 1)
        assert first == expected[:1]
        assert len(list(kv.iterdir())) == i, "prefill did not publish this prompt's KV"
        assert completion_ids(decode.url, model, prompt, MAX_TOKENS) == expected
        assert decode.log_text().count("External Cache Hit!") == i, "decode recomputed instead of loading KV"


def png_data_url(width: int, height: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((height, width, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_cluster(vl_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("e1pd1-logs")
    ec = tmp_path_factory.mktemp("ec-store")
    oracle = plain_vllm(vl_model, logs, name="vllm-vl")
    encoder = ascendserve("encoder", vl_model, logs, "--ec-path", str(ec))
    pd = ascendserve("pd", vl_model, logs, "--ec-path", str(ec), "--ec-enabled", "--log-level", "debug",
                     name="pd-vl")
    start_all(oracle, encoder, pd)
    yield oracle, encoder, pd, ec
    for p in (oracle, encoder, pd):
        p.stop()


def test_1e1pd_with_image_equals_plain_vllm(vl_cluster, vl_model):
    oracle, encoder, pd, ec = vl_cluster
    model = str(vl_model)
    for seed, (w, h) in enumerate([(112, 84), (160, 120)]):
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(w, h, seed)}},
            {"type": "text", "text": "Describe this picture in detail."},
        ]}]
        expected = chat_ids(oracle.url, model, messages, MAX_TOKENS)
        assert len(expected) == MAX_TOKENS and len(set(expected)) > 4
        # E runs the vision tower only and publishes the output by mm_hash.
        r = httpx.post(encoder.url + "/v1/chat/completions", timeout=120,
                       json={"model": model, "messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        hashes = {p.name for p in ec.iterdir() if (p / "encoder_cache.safetensors").is_file()}
        assert len(hashes) == seed + 1
        assert chat_ids(pd.url, model, messages, MAX_TOKENS) == expected
        loaded = set(re.findall(r"Success load encoder cache for hash (\w+)", pd.log_text()))
        assert loaded == hashes, "PD ran the encoder itself instead of loading E's output"


def test_1e1pd_text_only_needs_no_encoder(vl_cluster, vl_model):
    oracle, _, pd, _ = vl_cluster
    messages = [{"role": "user", "content": "Just text, no picture here."}]
    assert chat_ids(pd.url, str(vl_model), messages, MAX_TOKENS) == chat_ids(oracle.url, str(vl_model), messages, MAX_TOKENS)
