"""Gemma 3 text models: sandwich norms, (1 + w) RMSNorm, per-head q/k norms, GELU, interleaved sliding-window and
global attention with a RoPE base each, scaled embeddings, a tied head. Its vision tower runs on the PyTorch
backend (runlm.pytorch.vision)."""

from __future__ import annotations

from runlm.errors import ModelLoadError
from runlm.families.config import (
    FULL,
    SLIDING,
    ModelConfig,
    gguf_common_config,
    gguf_float,
    gguf_int,
    hf_common_config,
    hf_int,
    hf_rope,
    integer,
    number,
)
from runlm.families.registry import register
from runlm.families.spec import FamilySpec


def config_from_hf(cfg: dict) -> ModelConfig:
    text = cfg.get("text_config") or cfg
    common = hf_common_config(text)
    common["rope_theta"], common["rope_scaling"] = hf_rope(text, FULL)
    local_theta, local_scaling = hf_rope(text, SLIDING)
    if "rope_local_base_freq" in text:
        local_theta, local_scaling = number(text["rope_local_base_freq"], "config.json rope_local_base_freq"), None
    n = common["num_layers"]
    pattern = integer(hf_int(text, "sliding_window_pattern", 6), "config.json sliding_window_pattern", 1)
    layer_types = text.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if not isinstance(layer_types, list):
        raise ModelLoadError(f"config.json layer_types is {type(layer_types).__name__}, expected a list")
    softcaps = [text.get(k) for k in ("final_logit_softcapping", "attn_logit_softcapping")]
    return ModelConfig(
        **common,
        sliding_window=hf_int(text, "sliding_window", 4096),
        layer_types=list(layer_types),
        rope_local_theta=local_theta,
        local_rope_scaling=local_scaling,
        query_pre_attn_scalar=number(text.get("query_pre_attn_scalar", 256), "config.json query_pre_attn_scalar"),
        final_softcap=None if softcaps[0] is None else number(softcaps[0], "config.json final_logit_softcapping"),
        attn_softcap=None if softcaps[1] is None else number(softcaps[1], "config.json attn_logit_softcapping"),
    )


def config_from_gguf(gguf) -> ModelConfig:
    common = gguf_common_config(gguf)
    common["tie_embeddings"] = True
    n = common["num_layers"]
    pattern = gguf.arch_value("attention.sliding_window_pattern", 6)
    where = f"{gguf.path}: {gguf.architecture}.attention.sliding_window_pattern"
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ModelLoadError(f"{where} has {len(pattern)} entries for {n} layers")
        if not all(isinstance(flag, bool | int) for flag in pattern):
            raise ModelLoadError(f"{where} holds non-boolean entries")
        layer_types = [SLIDING if flag else FULL for flag in pattern]
    else:
        period = integer(pattern, where, 1)
        layer_types = [SLIDING if i % period < period - 1 else FULL for i in range(n)]
    hidden, heads = common["hidden_size"], common["num_heads"]
    # As llama.cpp does: 27B scales queries by hidden/heads, the other sizes by head_dim.
    scalar = hidden / heads if n == 62 else common["head_dim"]
    softcap = gguf.arch_value("final_logit_softcapping")  # 0 means none
    if softcap is not None:
        softcap = number(softcap, f"{gguf.path}: {gguf.architecture}.final_logit_softcapping", positive=False)
    return ModelConfig(
        **common,
        sliding_window=gguf_int(gguf, "attention.sliding_window", 4096),
        layer_types=layer_types,
        rope_local_theta=gguf_float(gguf, "rope.freq_base_swa", 10000.0),
        query_pre_attn_scalar=float(scalar),
        final_softcap=softcap or None,
    )


SPEC = register(FamilySpec(
    name="gemma",
    gguf_architectures=("gemma3",),
    hf_model_types=("gemma3_text", "gemma3"),
    config_from_gguf=config_from_gguf,
    config_from_hf=config_from_hf,
    norms="sandwich",
    qk_norm=True,
    activation="gelu_tanh",
    norm_offset=1.0,
    scale_embeddings=True,
    tied_head=True,
    gguf_names={"post_attention_layernorm": "post_attention_norm"},
    hf_prefixes=(("", ""), ("model.", "model.language_model."), ("", "language_model.")),
    chat_format="gemma",
    vision=True,
))
