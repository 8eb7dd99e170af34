"""Qwen3 dense models: the Llama block plus an RMSNorm over each head of the queries and keys."""

from __future__ import annotations

from runlm.families.config import ModelConfig, gguf_common_config, hf_common_config
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

SPEC = register(FamilySpec(
    name="qwen3",
    gguf_architectures=("qwen3",),
    hf_model_types=("qwen3",),
    config_from_gguf=lambda gguf: ModelConfig(**gguf_common_config(gguf)),
    config_from_hf=lambda cfg: ModelConfig(**hf_common_config(cfg)),
    qk_norm=True,
    # Qwen3-Embedding checkpoints are saved from Qwen3Model: its names have no `model.` prefix.
    hf_prefixes=(("", ""), ("model.", "")),
))
