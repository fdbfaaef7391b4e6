"""The tiny checkpoints: deterministic, loadable by transformers, tokenizer round-trips."""

from __future__ import annotations

import hashlib
import json

import pytest

from ascendserve.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, TinySpec, build, build_tokenizer, default_spec


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = build(tmp_path / "a", default_spec("text", seed=3))
    b = build(tmp_path / "b", default_spec("text", seed=3))
    c = build(tmp_path / "c", default_spec("text", seed=4))
    assert digest(a) == digest(b) != digest(c)


def test_tokenizer_round_trips_any_text():
    tok = build_tokenizer()
    text = "Grüße, 世界! tabs\tand\nnewlines 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1


def test_chat_template_places_image_pads():
    tok = build_tokenizer()
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "hi"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, chat_template=CHAT_TEMPLATE)
    assert text == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("kind", ["text", "vl", "mla"])
def test_transformers_loads_and_generates_varied_tokens(tmp_path, kind):
    import torch
    from transformers import AutoModelForImageTextToText, AutoModelForCausalLM, AutoTokenizer

    path = build(tmp_path / kind, default_spec(kind))
    cfg = json.loads((path / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    assert text_cfg["hidden_size"] // text_cfg["num_attention_heads"] >= 64
    cls = AutoModelForImageTextToText if kind == "vl" else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("The quick brown fox jumps over", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(set(out)) >= 6, out  # not collapsed to one repeated token


def test_head_dim_below_32_refused():
    with pytest.raises(ValueError, match="head_dim 16"):
        TinySpec(hidden=64, heads=4, kv_heads=2).check()
