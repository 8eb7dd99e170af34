"""Qwen2 and Qwen2.5 (and the DeepSeek-R1 distills built on them): the Llama block with a bias on Q, K and V."""

from __future__ import annotations

from runlm.families.config import ModelConfig, gguf_common_config, hf_common_config
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

SPEC = register(FamilySpec(
    name="qwen2",
    gguf_architectures=("qwen2",),
    hf_model_types=("qwen2",),
    config_from_gguf=lambda gguf: ModelConfig(**gguf_common_config(gguf)),
    config_from_hf=lambda cfg: ModelConfig(**hf_common_config(cfg)),
    # the Q/K/V biases are read wherever a file has them (every family's loader does)
))
