"""Ministral 3 (3B, 8B, 14B; llama.cpp's `mistral3`): the Llama block with YaRN, and Llama 4's attention temperature:
past each stretch of the original context, queries are scaled up by 1 + beta * log(1 + floor(position / original)).
YaRN's attention factor is mscale over mscale_all_dim (llama.cpp stores the latter as the log multiplier)."""

from __future__ import annotations

from runlm.errors import ModelLoadError
from runlm.families.config import ModelConfig, gguf_float, number
from runlm.families.llama import config_from_gguf as llama_config_from_gguf
from runlm.families.mistral import config_from_hf as mistral_config_from_hf
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def _with_temperature(config: ModelConfig, beta: float | None, where: str) -> ModelConfig:
    """`config` with its queries' temperature over position, stepping at YaRN's original context."""
    if beta:
        original = (config.rope_scaling or {}).get("original_max_position_embeddings")
        if not original:
            raise ModelLoadError(f"{where}: an attention temperature needs YaRN's original context to step at")
        config.attn_temperature, config.attn_temperature_length = beta, int(original)
    return config


def config_from_gguf(gguf) -> ModelConfig:
    return _with_temperature(llama_config_from_gguf(gguf), gguf_float(gguf, "attention.temperature_scale"),
                             f"{gguf.path}: {gguf.architecture}.attention.temperature_scale")


def config_from_hf(cfg: dict) -> ModelConfig:
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    beta = params.get("llama_4_scaling_beta")
    return _with_temperature(mistral_config_from_hf(cfg),
                             None if beta is None else number(beta, "config.json llama_4_scaling_beta"),
                             "config.json llama_4_scaling_beta")


SPEC = register(FamilySpec(
    name="mistral3",
    gguf_architectures=("mistral3",),
    hf_model_types=("ministral3",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    gguf_qk_interleaved=True,
))
