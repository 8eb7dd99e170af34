"""Llama 3.x and the models that share its architecture (SmolLM2 among them)."""

from __future__ import annotations

import torch

from runlm.errors import ModelLoadError
from runlm.models.base import CachedRunner, DecoderLM, WeightLoader
from runlm.models.config import ModelConfig, default_attention_scale, gguf_common_config, gguf_int, hf_common_config
from runlm.models.registry import Family, register_family
from runlm.nn import Attention, GatedMLP, PreNormBlock, RMSNorm, Rope, RopeSpec, rope_inv_freq


def build_prenorm_decoder(config: ModelConfig, weights: WeightLoader, qk_norm: bool = False) -> DecoderLM:
    """The llama-shaped stack; qwen3 adds per-head RMSNorm on queries and keys."""
    freq_factors = weights.source.tensor("rope_freqs.weight") if weights.source.has("rope_freqs.weight") else None
    rope = Rope(rope_inv_freq(RopeSpec.build(config.head_dim, config.rope_theta, config.rope_scaling), freq_factors))
    eps = config.rms_eps
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = Attention(
            qkv=weights.linear([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
            o_proj=weights.linear([p + "self_attn.o_proj.weight"]),
            n_heads=config.num_heads,
            n_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rope=rope,
            scale=default_attention_scale(config),
            q_norm=RMSNorm(weights.norm_weight(p + "self_attn.q_norm.weight"), eps) if qk_norm else None,
            k_norm=RMSNorm(weights.norm_weight(p + "self_attn.k_norm.weight"), eps) if qk_norm else None,
        )
        mlp = GatedMLP(
            weights.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            weights.linear([p + "mlp.down_proj.weight"]),
        )
        layers.append(
            PreNormBlock(
                RMSNorm(weights.norm_weight(p + "input_layernorm.weight"), eps),
                attn,
                RMSNorm(weights.norm_weight(p + "post_attention_layernorm.weight"), eps),
                mlp,
            )
        )
    head_name = "model.embed_tokens.weight" if config.tie_embeddings else "lm_head.weight"
    if not config.tie_embeddings and not weights.source.has("lm_head.weight"):
        head_name = "model.embed_tokens.weight"
    return DecoderLM(
        config,
        embed=weights.embedding("model.embed_tokens.weight"),
        layers=layers,
        norm=RMSNorm(weights.norm_weight("model.norm.weight"), eps),
        head=weights.linear([head_name]),
        ropes=[rope],
    )


class LlamaRunner(CachedRunner):
    family_name = "llama32"


def _config_from_hf(cfg: dict) -> ModelConfig:
    return ModelConfig(**hf_common_config(cfg))


def _config_from_gguf(gguf) -> ModelConfig:
    common = gguf_common_config(gguf)
    rope_dims = gguf_int(gguf, "rope.dimension_count", common["head_dim"])
    key_length = gguf.arch_value("attention.key_length")
    if key_length is not None and rope_dims != key_length:
        arch = gguf.architecture
        raise ModelLoadError(
            f"{gguf.path}: {arch}.attention.key_length is {key_length} but {arch}.rope.dimension_count is "
            f"{rope_dims}: runlm rotates whole heads (expected them equal)"
        )
    common["head_dim"] = rope_dims  # many llama GGUFs write only the rope dimension
    return ModelConfig(**common)


def _unpermute_rows(name: str, config: ModelConfig) -> torch.Tensor | None:
    """llama.cpp interleaves Q/K rows per head for its RoPE; undo it to transformers' half-split layout."""
    if name.endswith("self_attn.q_proj.weight"):
        heads = config.num_heads
    elif name.endswith("self_attn.k_proj.weight"):
        heads = config.num_kv_heads
    else:
        return None
    half = config.head_dim // 2
    gguf_order = torch.arange(heads * config.head_dim).reshape(heads, 2, half).transpose(1, 2).reshape(-1)
    return torch.argsort(gguf_order)


FAMILY = register_family(
    Family(
        name="llama32",
        gguf_architectures=("llama",),
        hf_model_types=("llama",),
        config_from_hf=_config_from_hf,
        config_from_gguf=_config_from_gguf,
        build=build_prenorm_decoder,
        runner=LlamaRunner,
        gguf_row_perm=_unpermute_rows,
    )
)
