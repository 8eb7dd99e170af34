"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention with Q/K/V biases, and a mixture of experts
beside one shared expert whose output a sigmoid of its own gate scales. The routed experts' weights are the softmax's,
not renormalized."""

from __future__ import annotations

from runlm.families.config import ModelConfig, gguf_common_config, gguf_experts, hf_common_config, hf_experts
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

SPEC = register(FamilySpec(
    name="qwen2moe",
    gguf_architectures=("qwen2moe",),
    hf_model_types=("qwen2_moe",),
    config_from_gguf=lambda gguf: ModelConfig(**gguf_common_config(gguf), **gguf_experts(gguf)),
    config_from_hf=lambda cfg: ModelConfig(**hf_common_config(cfg), **hf_experts(cfg)),
    experts="softmax_topk",
    shared_expert=True,
))
