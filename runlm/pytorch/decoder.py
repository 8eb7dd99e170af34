"""The PyTorch backend's modules for any family, built from its spec (runlm.families): one builder, no per-family
code. Quantized weights come from WeightLoader (GGUF blocks, packed or dense); kernels are chosen later, at load
(runlm.pytorch.fused)."""

from __future__ import annotations

import torch
from torch import nn

from runlm.errors import ModelLoadError
from runlm.families.config import ModelConfig, default_attention_scale
from runlm.families.spec import FamilySpec
from runlm.formats.gguf import GGUFSource
from runlm.pytorch.base import DecoderLM, WeightLoader
from runlm.pytorch.nn import Attention, GatedMLP, PreNormBlock, RMSNorm, Rope, SandwichBlock
from runlm.rope import rope_frequencies, rope_index


def build_decoder(spec: FamilySpec, config: ModelConfig, weights: WeightLoader) -> DecoderLM:
    """Embedding, one block per layer as the spec places its norms, final norm and LM head."""
    if spec.experts and config.num_experts:
        raise ModelLoadError(f"{weights.source.path}: {spec.name} is a mixture of experts, which runs on the native "
                             f"runtime only: load its GGUF file (the PyTorch backend has no experts)")
    if spec.values_from_keys or spec.value_norm or spec.layer_scalar:
        raise ModelLoadError(f"{weights.source.path}: {spec.name} runs on the native runtime only: load its GGUF file "
                             f"(the PyTorch backend has no per-kind heads, shared keys or layer scalars)")
    if config.attn_temperature:
        raise ModelLoadError(f"{weights.source.path}: {spec.name}'s attention temperature runs on the native runtime "
                             f"only: load a GGUF file of it (the PyTorch backend does not scale queries by position)")
    offset = 0.0 if isinstance(weights.source, GGUFSource) else spec.norm_offset  # GGUF stores 1 + w already
    eps = config.rms_eps

    def norm(name: str) -> RMSNorm:
        return RMSNorm(weights.norm_weight(name), eps, offset)

    def bias(names: list[str]) -> torch.Tensor | None:
        present = [weights.source.has(name) for name in names]
        if not any(present):
            return None
        if not all(present):
            raise ModelLoadError(f"{weights.source.path}: has some of a projection's biases but not all of "
                                 f"{', '.join(names)}")
        return torch.cat([weights.source.tensor(name).float() for name in names])

    freq_factors = weights.source.tensor("rope_freqs.weight") if weights.source.has("rope_freqs.weight") else None
    factors = None if freq_factors is None else freq_factors.numpy()
    ropes = [Rope(frequencies, scale) for frequencies, scale in rope_frequencies(config, factors)]
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        spec.refuse_unapplied(weights.source.has, i, weights.source.path, config)
        sliding = config.is_sliding(i)
        attn = Attention(
            qkv=weights.linear(spec.qkv_names(p)),
            o_proj=weights.linear([p + "self_attn.o_proj.weight"]),
            n_heads=config.num_heads,
            n_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rope=ropes[rope_index(config, i)],
            scale=default_attention_scale(config),
            q_norm=norm(p + "self_attn.q_norm.weight") if spec.qk_norm else None,
            k_norm=norm(p + "self_attn.k_norm.weight") if spec.qk_norm else None,
            window=config.sliding_window if sliding else None,
            softcap=config.attn_softcap,
            qkv_bias=bias(spec.qkv_names(p, "bias")),
            qk_norm_whole=spec.qk_norm_whole,
        )
        mlp = GatedMLP(
            weights.linear(spec.gate_up_names(p)),
            weights.linear([p + "mlp.down_proj.weight"]),
            activation=spec.activation,
        )
        norms = [nn.Identity() if name is None else norm(p + name + ".weight") for name in spec.norm_names]
        scale = config.residual_scale
        layers.append(SandwichBlock(norms, attn, mlp, scale) if len(norms) == 4
                      else PreNormBlock(norms[0], attn, norms[1], mlp, scale))
    head = spec.head_name(weights.source.has("lm_head.weight"), config)
    return DecoderLM(
        config,
        embed=weights.embedding("model.embed_tokens.weight"),
        layers=layers,
        norm=norm("model.norm.weight"),
        head=weights.linear([head]),
        ropes=ropes,
        embed_scale=spec.embed_scale(config),
    )


__all__ = ["build_decoder"]
