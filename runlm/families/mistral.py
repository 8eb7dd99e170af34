"""Mistral and Ministral checkpoints in Hugging Face form: the Llama block, with every layer's attention limited to
`sliding_window` where config.json sets one (Mistral 7B v0.1). llama.cpp's converter writes them as `llama` GGUFs,
which the llama spec reads; their templates and Tekken tokenizers come from the file."""

from __future__ import annotations

from runlm.families.config import SLIDING, ModelConfig, hf_common_config, hf_int
from runlm.families.llama import config_from_gguf
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def config_from_hf(cfg: dict) -> ModelConfig:
    config = ModelConfig(**hf_common_config(cfg))
    if cfg.get("sliding_window") is not None:
        config.sliding_window = hf_int(cfg, "sliding_window")
        config.layer_types = [SLIDING] * config.num_layers
    return config


SPEC = register(FamilySpec(
    name="mistral",
    gguf_architectures=(),
    hf_model_types=("mistral",),
    config_from_gguf=config_from_gguf,  # unused: their GGUFs say `llama`
    config_from_hf=config_from_hf,
))
