"""SmolLM3: the Llama block, with RoPE left out of every fourth layer (NoPE layers)."""

from __future__ import annotations

from runlm.errors import ModelLoadError
from runlm.families.config import ModelConfig, hf_common_config, integer
from runlm.families.llama import config_from_gguf as llama_config_from_gguf
from runlm.families.registry import register
from runlm.families.spec import FamilySpec

# llama.cpp's converter writes no key for the NoPE layers: like llama.cpp, read the released models' interval.
NO_ROPE_INTERVAL = 4


def every_fourth_without_rope(layers: int) -> list[bool]:
    return [(i + 1) % NO_ROPE_INTERVAL != 0 for i in range(layers)]


def config_from_gguf(gguf) -> ModelConfig:
    config = llama_config_from_gguf(gguf)
    config.rope_layers = every_fourth_without_rope(config.num_layers)
    return config


def config_from_hf(cfg: dict) -> ModelConfig:
    config = ModelConfig(**hf_common_config(cfg))
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = integer(cfg.get("no_rope_layer_interval", NO_ROPE_INTERVAL), "config.json no_rope_layer_interval", 1)
        flags = [(i + 1) % interval != 0 for i in range(config.num_layers)]
    if not isinstance(flags, list) or not all(flag in (0, 1) for flag in flags):
        raise ModelLoadError("config.json no_rope_layers must be a list of 0 / 1 flags, one per layer")
    config.rope_layers = [bool(flag) for flag in flags]  # 1: the layer uses RoPE
    return config


SPEC = register(FamilySpec(
    name="smollm3",
    gguf_architectures=("smollm3",),
    hf_model_types=("smollm3",),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    gguf_qk_interleaved=True,
))
