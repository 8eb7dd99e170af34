"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and a mixture of experts in place of every MLP.
Each token takes the top experts of a softmax over all of them, their weights renormalized to sum 1, as llama.cpp
runs every qwen3moe file."""

from __future__ import annotations

from runlm.families.config import ModelConfig, gguf_common_config, gguf_experts, hf_common_config, hf_experts
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

SPEC = register(FamilySpec(
    name="qwen3moe",
    gguf_architectures=("qwen3moe",),
    hf_model_types=("qwen3_moe",),
    config_from_gguf=lambda gguf: ModelConfig(**gguf_common_config(gguf), **gguf_experts(gguf, normalize=True)),
    config_from_hf=lambda cfg: ModelConfig(**hf_common_config(cfg), **hf_experts(cfg)),
    qk_norm=True,
    experts="softmax_topk",
))
