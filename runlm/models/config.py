"""Architecture numbers and the readers that take them from config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from runlm.errors import ModelLoadError


@dataclass
class ModelConfig:
    """Architecture numbers, read from config.json or GGUF metadata by each family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position: int
    rope_scaling: dict | None = None
    tie_embeddings: bool = True
    # Gemma-style extras; families that do not use them leave the defaults.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None
    local_rope_scaling: dict | None = None
    query_pre_attn_scalar: float | None = None
    final_softcap: float | None = None
    attn_softcap: float | None = None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"


def hf_rope(config: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json in either the transformers 4 or 5 layout."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(params["rope_theta"]), scaling
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(config.get("rope_theta", 10000.0)), scaling


def default_attention_scale(config: ModelConfig) -> float:
    return 1.0 / math.sqrt(config.query_pre_attn_scalar or config.head_dim)


def gguf_int(gguf, key: str, default: int | None = None) -> int:
    value = gguf.arch_value(key, default)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata lacks {gguf.architecture}.{key}")
    return int(value)


def gguf_common_config(gguf) -> dict[str, Any]:
    """The ModelConfig fields every llama.cpp architecture writes the same way."""
    heads = gguf_int(gguf, "attention.head_count")
    hidden = gguf_int(gguf, "embedding_length")
    vocab = gguf.arch_value("vocab_size") or len(gguf.metadata.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelLoadError(f"{gguf.path}: cannot tell the vocabulary size")
    scaling = None
    if gguf.arch_value("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(gguf.arch_value("rope.scaling.factor"))}
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=gguf_int(gguf, "feed_forward_length"),
        num_layers=gguf_int(gguf, "block_count"),
        num_heads=heads,
        num_kv_heads=gguf_int(gguf, "attention.head_count_kv", heads),
        head_dim=gguf_int(gguf, "attention.key_length", hidden // heads),
        rms_eps=float(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf.arch_value("rope.freq_base", 10000.0)),
        max_position=gguf_int(gguf, "context_length", 4096),
        rope_scaling=scaling,
        tie_embeddings=not gguf.has("output.weight"),
    )


def hf_common_config(cfg: dict) -> dict[str, Any]:
    """The ModelConfig fields config.json spells the same way across families."""
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = hf_rope(cfg)
        return dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling=scaling,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from exc
