"""Llama 3.x and the models that share its architecture (SmolLM2 among them; Mixtral, whose llama GGUFs hold a
mixture of experts: a softmax's top experts, renormalized, as llama.cpp runs them)."""

from __future__ import annotations

from runlm.errors import ModelLoadError
from runlm.families.config import ModelConfig, gguf_common_config, gguf_experts, gguf_int, hf_common_config
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def config_from_gguf(gguf) -> ModelConfig:
    common = gguf_common_config(gguf)
    rope_dims = gguf_int(gguf, "rope.dimension_count", common["head_dim"])
    key_length = gguf.arch_value("attention.key_length")
    if key_length is not None and rope_dims != key_length:
        arch = gguf.architecture
        raise ModelLoadError(
            f"{gguf.path}: {arch}.attention.key_length is {key_length} but {arch}.rope.dimension_count is "
            f"{rope_dims}: runlm rotates whole heads (expected them equal)"
        )
    common["head_dim"] = rope_dims  # many llama GGUFs write only the rope dimension
    return ModelConfig(**common, **gguf_experts(gguf, normalize=True, required=False))


SPEC = register(FamilySpec(
    name="llama32",
    gguf_architectures=("llama",),
    hf_model_types=("llama",),
    config_from_gguf=config_from_gguf,
    config_from_hf=lambda cfg: ModelConfig(**hf_common_config(cfg)),
    gguf_qk_interleaved=True,
    experts="softmax_topk",
))
