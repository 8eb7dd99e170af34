"""IBM Granite 3.x (dense): the Llama block with four multipliers, on the embeddings, on each sublayer's output
before the residual add, on the attention scores (instead of 1/sqrt(head_dim)) and dividing the logits."""

from __future__ import annotations

from runlm.families.config import ModelConfig, gguf_float, hf_common_config, number
from runlm.families.llama import config_from_gguf as llama_config_from_gguf
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

_GGUF_KEYS = {"embedding_scale": "embedding_scale", "residual_scale": "residual_scale",
              "attention_scale": "attention.scale", "logit_scale": "logit_scale"}
_HF_KEYS = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
            "attention_scale": "attention_multiplier", "logit_scale": "logits_scaling"}


def config_from_gguf(gguf) -> ModelConfig:
    config = llama_config_from_gguf(gguf)
    for field, key in _GGUF_KEYS.items():
        value = gguf_float(gguf, key)
        if value is not None:
            setattr(config, field, value)
    return config


def config_from_hf(cfg: dict) -> ModelConfig:
    config = ModelConfig(**hf_common_config(cfg))
    for field, key in _HF_KEYS.items():
        if cfg.get(key) is not None:
            setattr(config, field, number(cfg[key], f"config.json {key}"))
    return config


SPEC = register(FamilySpec(
    name="granite",
    gguf_architectures=("granite",),
    hf_model_types=("granite",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    gguf_qk_interleaved=True,
))


