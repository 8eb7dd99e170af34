"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and a mixture of experts in place of every MLP.
Each token takes the top experts of a softmax over all of them, their weights renormalized to sum 1, as llama.cpp
runs every qwen3moe file."""

from __future__ import annotations

from runlm.errors import ModelLoadError
from runlm.families.config import ModelConfig, gguf_common_config, gguf_int, hf_common_config, hf_int
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def config_from_gguf(gguf) -> ModelConfig:
    normalize = gguf.arch_value("expert_weights_norm", True)
    if not isinstance(normalize, bool):
        raise ModelLoadError(f"{gguf.path}: {gguf.architecture}.expert_weights_norm is {normalize!r}, expected a bool")
    return ModelConfig(
        **gguf_common_config(gguf),
        num_experts=gguf_int(gguf, "expert_count"),
        experts_per_token=gguf_int(gguf, "expert_used_count"),
        expert_ffn=gguf_int(gguf, "expert_feed_forward_length"),
        expert_normalize=normalize,
    )


def config_from_hf(cfg: dict) -> ModelConfig:
    return ModelConfig(
        **hf_common_config(cfg),
        num_experts=hf_int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts"),
        experts_per_token=hf_int(cfg, "num_experts_per_tok"),
        expert_ffn=hf_int(cfg, "moe_intermediate_size"),
        expert_normalize=cfg.get("norm_topk_prob") is True,
    )


SPEC = register(FamilySpec(
    name="qwen3moe",
    gguf_architectures=("qwen3moe",),
    hf_model_types=("qwen3_moe",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    qk_norm=True,
    experts="softmax_topk",
))
