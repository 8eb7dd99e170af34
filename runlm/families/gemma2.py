"""Gemma 2: Gemma 3's sandwich block without q/k norms, with soft caps on the attention scores and the logits, and
sliding-window attention in every other layer (the even ones), all with one RoPE base."""

from __future__ import annotations

from runlm.families.config import (
    ModelConfig,
    alternating_layers,
    gguf_common_config,
    gguf_float,
    gguf_int,
    hf_common_config,
    hf_int,
    number,
)
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

_LAYERS_OF_27B = 46  # which scales its queries by hidden / heads, as llama.cpp reads it



def config_from_gguf(gguf) -> ModelConfig:
    common = gguf_common_config(gguf)
    n, hidden, heads = common["num_layers"], common["hidden_size"], common["num_heads"]
    return ModelConfig(
        **common,
        sliding_window=gguf_int(gguf, "attention.sliding_window", 4096),
        layer_types=alternating_layers(n),
        query_pre_attn_scalar=float(hidden / heads if n == _LAYERS_OF_27B else common["head_dim"]),
        final_softcap=gguf_float(gguf, "final_logit_softcapping"),
        attn_softcap=gguf_float(gguf, "attn_logit_softcapping"),
    )


def config_from_hf(cfg: dict) -> ModelConfig:
    common = hf_common_config(cfg)
    caps = {key: None if cfg.get(key) is None else number(cfg[key], f"config.json {key}")
            for key in ("final_logit_softcapping", "attn_logit_softcapping")}
    return ModelConfig(
        **common,
        sliding_window=hf_int(cfg, "sliding_window", 4096),
        layer_types=list(cfg.get("layer_types") or alternating_layers(common["num_layers"])),
        query_pre_attn_scalar=number(cfg.get("query_pre_attn_scalar", common["head_dim"]),
                                     "config.json query_pre_attn_scalar"),
        final_softcap=caps["final_logit_softcapping"],
        attn_softcap=caps["attn_logit_softcapping"],
    )


SPEC = register(FamilySpec(
    name="gemma2",
    gguf_architectures=("gemma2",),
    hf_model_types=("gemma2",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    norms="sandwich",
    activation="gelu_tanh",
    norm_offset=1.0,
    scale_embeddings=True,
    tied_head=True,
    gguf_names={"post_attention_layernorm": "post_attention_norm"},
    chat_format="gemma",
))
