"""Gemma 4 text models (31B, 26B-A4B, E2B, E4B): Gemma 3's sandwich block with plain RMSNorm weights, sliding-window
layers with heads of their own size and count beside global layers whose keys may double as values, an unweighted
norm on the values, queries unscaled, partial ("proportional") RoPE on the global layers, and a scale on each block's
output. E2B and E4B add per-layer inputs (an embedding of its own per layer, mixed with a projection of the token's
embedding) and end in layers that reuse an earlier layer's keys and values, with MLPs of their own widths. 26B-A4B
runs a mixture of experts beside each dense MLP: top-k of a softmax, renormalized, times a scale per expert, its
router reading the block's residual."""

from __future__ import annotations

from runlm.errors import ModelLoadError
from runlm.families.config import (
    FULL,
    SLIDING,
    ModelConfig,
    gguf_common_config,
    gguf_experts,
    gguf_float,
    gguf_int,
    integer,
    number,
)
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def _by_layer_type(gguf, key: str, layer_types: list[str]) -> tuple[int, int | None]:
    """A per-layer GGUF value that is one number, or a list with one value for all global and one for all sliding
    layers: (global, sliding or None)."""
    where = f"{gguf.path}: {gguf.architecture}.{key}"
    value = gguf.arch_value(key)
    if not isinstance(value, list):
        return integer(value, where), None
    if len(value) != len(layer_types):
        raise ModelLoadError(f"{where} has {len(value)} entries for {len(layer_types)} layers")
    kinds = {kind: {integer(v, where) for v, t in zip(value, layer_types) if t == kind} for kind in (FULL, SLIDING)}
    if any(len(values) > 1 for values in kinds.values()):
        raise ModelLoadError(f"{where} differs between layers of one kind, which runlm does not support")
    (full,) = kinds[FULL] or kinds[SLIDING]
    return full, next(iter(kinds[SLIDING]), None)


def config_from_gguf(gguf) -> ModelConfig:
    where = f"{gguf.path}: {gguf.architecture}.attention.sliding_window_pattern"
    pattern = gguf.arch_value("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or not all(isinstance(flag, bool) for flag in pattern):
        raise ModelLoadError(f"{where} is missing or not a list of booleans")
    layer_types = [SLIDING if flag else FULL for flag in pattern]
    kv_heads, sliding_kv_heads = _by_layer_type(gguf, "attention.head_count_kv", layer_types)
    ffn = gguf.arch_value("feed_forward_length")
    layer_ffn = ffn if isinstance(ffn, list) else []  # E2B's shared layers have MLPs twice as wide
    common = gguf_common_config(gguf, num_kv_heads=kv_heads, intermediate_size=max(layer_ffn) if layer_ffn and all(
        type(width) is int for width in layer_ffn) else None)
    if len(layer_types) != common["num_layers"]:
        raise ModelLoadError(f"{where} has {len(layer_types)} entries for {common['num_layers']} layers")
    sliding_head_dim = gguf_int(gguf, "attention.key_length_swa", common["head_dim"])
    for key, want in (("attention.value_length", common["head_dim"]), ("attention.value_length_swa", sliding_head_dim),
                      ("rope.dimension_count_swa", sliding_head_dim)):
        if gguf_int(gguf, key, want) != want:
            raise ModelLoadError(f"{gguf.path}: {gguf.architecture}.{key} is {gguf_int(gguf, key)}, runlm supports "
                                 f"only {want}")
    softcap = gguf.arch_value("final_logit_softcapping")  # 0 means none
    if softcap is not None:
        softcap = number(softcap, f"{gguf.path}: {gguf.architecture}.final_logit_softcapping", positive=False)
    return ModelConfig(
        **common,
        sliding_window=gguf_int(gguf, "attention.sliding_window", 512),
        layer_types=layer_types,
        rope_local_theta=gguf_float(gguf, "rope.freq_base_swa", 10000.0),
        attention_scale=1.0,  # queries are not scaled: their norm sets their size
        final_softcap=softcap or None,
        sliding_head_dim=sliding_head_dim,
        sliding_kv_heads=sliding_kv_heads,
        shared_kv_layers=gguf_int(gguf, "attention.shared_kv_layers", 0),
        per_layer_input=gguf_int(gguf, "embedding_length_per_layer_input", 0),
        layer_ffn=list(layer_ffn),
        **gguf_experts(gguf, normalize=True, required=False),
    )


def config_from_hf(cfg: dict) -> ModelConfig:
    raise ModelLoadError("Gemma 4 runs from GGUF files only, on the native runtime: convert the directory with "
                         "llama.cpp's convert_hf_to_gguf.py")


SPEC = register(FamilySpec(
    name="gemma4",
    gguf_architectures=("gemma4",),
    hf_model_types=("gemma4_text", "gemma4"),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    norms="sandwich",
    qk_norm=True,
    activation="gelu_tanh",
    scale_embeddings=True,
    values_from_keys=True,
    value_norm=True,
    layer_scalar=True,
    gguf_names={"post_attention_layernorm": "post_attention_norm", "per_layer_input_gate": "inp_gate",
                "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm",
                "pre_feedforward_layernorm_2": "pre_ffw_norm_2", "post_feedforward_layernorm_1": "post_ffw_norm_1",
                "post_feedforward_layernorm_2": "post_ffw_norm_2"},
    experts="softmax_topk",
    experts_beside_mlp=True,
    chat_format="gemma4",
))
