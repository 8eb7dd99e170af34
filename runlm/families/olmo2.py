"""OLMo 2: RMSNorm after attention and after the MLP (none before), and one RMSNorm over the whole query and key
projections."""

from __future__ import annotations

from runlm.families.config import ModelConfig, gguf_common_config, hf_common_config
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

SPEC = register(FamilySpec(
    name="olmo2",
    gguf_architectures=("olmo2",),
    hf_model_types=("olmo2",),
    config_from_gguf=lambda gguf: ModelConfig(**gguf_common_config(gguf)),
    config_from_hf=lambda cfg: ModelConfig(**hf_common_config(cfg)),
    norms="post",
    qk_norm=True,
    qk_norm_whole=True,
    gguf_names={"post_attention_layernorm": "post_attention_norm"},
))
