"""Random-weight tiny checkpoints that vLLM and transformers both load, offline.

`ascendserve model tiny --kind text|vl|moe|mla --out DIR` writes a complete
HuggingFace-style directory: config, safetensors weights, a byte-level BPE
tokenizer (every byte is a token, so any text round-trips without a
downloaded vocabulary), the Qwen chat template and, for `vl`, the image and
video processors. `moe` is a Qwen3-MoE (8 experts, top-2) for the expert-
and data-parallel layouts. `mla` is a DeepSeek-V2 (multi-head latent attention
with DeepSeek's cache geometry, kv_lora_rank 512 + rope 64 = one 576-wide
latent per token and layer; the second layer is MoE, 8 routed experts top-2
and a shared expert), the model family P/D clusters are built for. Weights are drawn from N(0, std) with a seeded generator,
so the same seed gives byte-identical weights. std defaults to 0.15: with
the usual 0.02 a tiny random model emits one repeated token and greedy
equality tests prove little.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

KINDS = ("text", "vl", "moe", "mla")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
BYTE_VOCAB = 256
VOCAB_SIZE = BYTE_VOCAB + len(SPECIAL_TOKENS)  # every id decodes to something


CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] in ('image', 'image_url', 'image_pil') -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] in ('video', 'video_url') -%}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TinySpec:
    kind: str = "text"
    seed: int = 0
    std: float = 0.15
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    max_positions: int = 8192
    vision_depth: int = 2
    vision_hidden: int = 64
    vision_heads: int = 2
    experts: int = 8  # moe
    experts_per_token: int = 2
    moe_intermediate: int = 64
    kv_lora_rank: int = 512  # mla: latent width; + rope_dim is the cached width
    rope_dim: int = 64  # mla: decoupled rope part of q and k
    nope_dim: int = 32  # mla: per-head q/k part without rope
    v_dim: int = 32  # mla: per-head value width
    shared_experts: int = 1  # mla
    dense_layers: int = 1  # mla: the first layers use a dense MLP

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def check(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind in ("moe", "mla") and not 0 < self.experts_per_token <= self.experts:
            raise ValueError("experts_per_token must be in 1..experts")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError("hidden must divide by heads, heads by kv_heads")
        if self.head_dim < 32:
            raise ValueError(
                f"head_dim {self.head_dim} < 32: vLLM's CPU attention rejects it; "
                "lower heads or raise hidden"
            )


def default_spec(kind: str, seed: int = 0) -> TinySpec:
    """The specs the tests and demo use: text hidden 256, VL text hidden 128,
    MoE hidden 128 with 8 experts of intermediate 64, top-2; MLA hidden 256,
    4 heads, one dense and one MoE layer."""
    if kind == "mla":
        return TinySpec(kind="mla", seed=seed)
    if kind == "moe":
        return TinySpec(kind="moe", seed=seed, hidden=128, heads=4, kv_heads=2, intermediate=256)
    if kind == "vl":
        return TinySpec(kind="vl", seed=seed, hidden=128, heads=2, kv_heads=1, intermediate=256)
    return TinySpec(kind=kind, seed=seed)


def token_id(name: str) -> int:
    return BYTE_VOCAB + SPECIAL_TOKENS.index(name)


def build_tokenizer():
    """A byte-level BPE with no merges: 256 byte tokens, then the specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _text_config_kwargs(spec: TinySpec, mrope: bool) -> dict:
    rope: dict = {"rope_type": "default", "rope_theta": 10000.0}
    if mrope:
        # Qwen2.5-VL splits head_dim / 2 rotary pairs over (t, h, w).
        half = spec.head_dim // 2
        rope |= {"type": "mrope", "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8]}
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        rope_parameters=rope,
        bos_token_id=token_id("<|endoftext|>"),
        eos_token_id=token_id("<|im_end|>"),
        pad_token_id=token_id("<|endoftext|>"),
        tie_word_embeddings=False,
        use_sliding_window=False,
    )


def _build_model(spec: TinySpec):
    if spec.kind == "text":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(**_text_config_kwargs(spec, mrope=False))
        config.architectures = ["Qwen2ForCausalLM"]
        model_cls = Qwen2ForCausalLM
    elif spec.kind == "moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        kwargs = _text_config_kwargs(spec, mrope=False)
        kwargs.pop("use_sliding_window")
        config = Qwen3MoeConfig(
            **kwargs,
            head_dim=spec.head_dim,
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
        model_cls = Qwen3MoeForCausalLM
    elif spec.kind == "mla":
        config, model_cls = _mla_config(spec)
    else:
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        vision = dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden,
            intermediate_size=spec.vision_hidden * 2,
            num_heads=spec.vision_heads,
            out_hidden_size=spec.hidden,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[spec.vision_depth - 1],
            in_channels=3,
        )
        config = Qwen2_5_VLConfig(
            text_config=_text_config_kwargs(spec, mrope=True),
            vision_config=vision,
            image_token_id=token_id("<|image_pad|>"),
            video_token_id=token_id("<|video_pad|>"),
            vision_start_token_id=token_id("<|vision_start|>"),
            vision_end_token_id=token_id("<|vision_end|>"),
            tie_word_embeddings=False,
        )
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
        model_cls = Qwen2_5_VLForConditionalGeneration
    config.dtype = "float32"
    return model_cls(config)


def _mla_config(spec: TinySpec):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    kwargs = _text_config_kwargs(spec, mrope=False)
    kwargs.pop("use_sliding_window")
    kwargs["num_key_value_heads"] = spec.heads  # MLA: every head reads the one latent
    config = DeepseekV2Config(
        **kwargs,
        kv_lora_rank=spec.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=spec.rope_dim,
        qk_nope_head_dim=spec.nope_dim,
        v_head_dim=spec.v_dim,
        n_routed_experts=spec.experts,
        num_experts_per_tok=spec.experts_per_token,
        n_shared_experts=spec.shared_experts,
        moe_intermediate_size=spec.moe_intermediate,
        first_k_dense_replace=spec.dense_layers,
        moe_layer_freq=1,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    )
    config.architectures = ["DeepseekV2ForCausalLM"]
    return config, DeepseekV2ForCausalLM


def _randomize(model, spec: TinySpec) -> None:
    import torch

    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * spec.std)


def _write_processor(out: Path, tokenizer) -> None:
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    pixels = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=pixels),
        video_processor=Qwen2VLVideoProcessor(size=pixels),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)


def build(out: str | os.PathLike, spec: TinySpec) -> Path:
    """Write the checkpoint to `out` (created if missing) and return its path."""
    spec.check()
    import torch
    from transformers import GenerationConfig

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = _build_model(spec)
    _randomize(model, spec)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=token_id("<|endoftext|>"),
        eos_token_id=token_id("<|im_end|>"),
        pad_token_id=token_id("<|endoftext|>"),
    ).save_pretrained(out_dir)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    if spec.kind == "vl":
        _write_processor(out_dir, tokenizer)
    (out_dir / "ascendserve_tiny.json").write_text(
        json.dumps({"kind": spec.kind, "seed": spec.seed, "std": spec.std}, indent=1)
    )
    return out_dir
