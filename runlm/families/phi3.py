"""Phi-3, Phi-3.5 and Phi-4-mini: the Llama block with Q/K/V stored as one projection and gate/up as another,
partial RoPE (Phi-4-mini rotates 96 of 128 values) and LongRoPE's per-frequency factors for 128k contexts."""

from __future__ import annotations

import numpy as np

from runlm.errors import ModelLoadError
from runlm.families.config import (
    SLIDING,
    ModelConfig,
    gguf_common_config,
    gguf_float,
    gguf_int,
    hf_common_config,
    number,
)
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def _window(config: ModelConfig, window) -> ModelConfig:
    """Phi-3 mini 4k attends over a sliding window; a window as long as the context (Phi-3.5's) is none."""
    if window and window < config.max_position:
        config.sliding_window, config.layer_types = window, [SLIDING] * config.num_layers
    return config


def _factors(gguf, name: str) -> list[float]:
    raw = gguf.raw(name)
    if raw.type_name != "F32" or len(raw.shape) != 1:
        raise ModelLoadError(f"{gguf.path}: tensor {name!r} must be a F32 vector, not {raw.type_name} {raw.shape}")
    return np.frombuffer(raw.read_rows(0, 1).tobytes(), dtype=np.float32).astype(float).tolist()


def config_from_gguf(gguf) -> ModelConfig:
    config = ModelConfig(**gguf_common_config(gguf))
    if gguf.has("rope_factors_long.weight") or gguf.has("rope_factors_short.weight"):
        config.rope_scaling = {
            "rope_type": "longrope",
            "original_max_position_embeddings": gguf_int(gguf, "rope.scaling.original_context_length"),
            "long_factor": _factors(gguf, "rope_factors_long.weight"),
            "short_factor": _factors(gguf, "rope_factors_short.weight"),
        }
        if (factor := gguf_float(gguf, "rope.scaling.attn_factor")) is not None:
            config.rope_scaling["attention_factor"] = factor
    return _window(config, gguf.arch_value("attention.sliding_window"))


def config_from_hf(cfg: dict) -> ModelConfig:
    config = ModelConfig(**hf_common_config(cfg))
    window = cfg.get("sliding_window")
    return _window(config, None if window is None else int(number(window, "config.json sliding_window")))


SPEC = register(FamilySpec(
    name="phi3",
    gguf_architectures=("phi3",),
    hf_model_types=("phi3",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    fused_qkv=True,
    fused_gate_up=True,
    gguf_names={"mlp.gate_up_proj": "ffn_up"},
))
