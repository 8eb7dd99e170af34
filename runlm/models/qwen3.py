"""Qwen3 dense models: the llama stack plus per-head RMSNorm on queries and keys."""

from __future__ import annotations

from runlm.models.base import CachedRunner, WeightLoader
from runlm.models.config import ModelConfig, gguf_common_config, hf_common_config
from runlm.models.llama import build_prenorm_decoder
from runlm.models.registry import Family, register_family


class Qwen3Runner(CachedRunner):
    family_name = "qwen3"


def _build(config: ModelConfig, weights: WeightLoader):
    return build_prenorm_decoder(config, weights, qk_norm=True)


FAMILY = register_family(
    Family(
        name="qwen3",
        gguf_architectures=("qwen3",),
        hf_model_types=("qwen3",),
        config_from_hf=lambda cfg: ModelConfig(**hf_common_config(cfg)),
        config_from_gguf=lambda gguf: ModelConfig(**gguf_common_config(gguf)),
        build=_build,
        runner=Qwen3Runner,
        # Qwen3-Embedding checkpoints are saved from Qwen3Model: its names have no `model.` prefix.
        hf_prefixes=(("", ""), ("model.", "")),
    )
)
