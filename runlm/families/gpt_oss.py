"""gpt-oss (gpt-oss-20b, gpt-oss-120b): pre-norm blocks with biases on every projection, attention sinks, sliding
windows of 128 in every other layer (the even ones), YaRN without truncation, and a mixture of experts whose router
softmaxes the top logits and whose experts run a clamped SwiGLU. Its experts come as MXFP4 in released files."""

from __future__ import annotations

from runlm.families.config import (
    ModelConfig,
    alternating_layers,
    gguf_common_config,
    gguf_experts,
    gguf_int,
    hf_common_config,
    hf_experts,
    hf_int,
)
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def _untruncated(scaling: dict | None) -> dict | None:
    """gpt-oss's YaRN blends over the exact correction range, not one rounded to whole dimensions."""
    return scaling if scaling is None or scaling.get("rope_type") != "yarn" else {**scaling, "truncate": False}


def config_from_gguf(gguf) -> ModelConfig:
    common = gguf_common_config(gguf)
    common["rope_scaling"] = _untruncated(common["rope_scaling"])
    return ModelConfig(
        **common,
        sliding_window=gguf_int(gguf, "attention.sliding_window", 128),
        layer_types=alternating_layers(common["num_layers"]),
        **gguf_experts(gguf),
    )


def config_from_hf(cfg: dict) -> ModelConfig:
    common = hf_common_config(cfg)
    return ModelConfig(
        **common,
        sliding_window=hf_int(cfg, "sliding_window", 128),
        layer_types=list(cfg.get("layer_types") or alternating_layers(common["num_layers"])),
        **hf_experts(cfg, ffn_key="intermediate_size"),
    )


SPEC = register(FamilySpec(
    name="gpt-oss",
    gguf_architectures=("gpt-oss",),
    hf_model_types=("gpt_oss",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    activation="swiglu_oai",
    experts="topk_softmax",
    biases=True,
    attention_sinks=True,
    gguf_names={"post_attention_layernorm": "post_attention_norm"},
))
