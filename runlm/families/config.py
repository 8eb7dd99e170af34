"""Architecture numbers and the readers that take them from config.json or GGUF metadata."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runlm.errors import ModelLoadError


@dataclass
class ModelConfig:
    """Architecture numbers, read from config.json or GGUF metadata by each family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position: int
    rope_scaling: dict | None = None
    tie_embeddings: bool = True
    # Gemma-style extras; families that do not use them leave the defaults.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None
    local_rope_scaling: dict | None = None
    query_pre_attn_scalar: float | None = None
    final_softcap: float | None = None
    attn_softcap: float | None = None
    # Granite's multipliers: embeddings, each sublayer's output before the residual add, the attention scale (instead
    # of 1/sqrt(head_dim)), and the divisor of the logits.
    embedding_scale: float | None = None
    residual_scale: float = 1.0
    attention_scale: float | None = None
    logit_scale: float | None = None
    # Layers that apply RoPE (SmolLM3 skips it in every fourth); empty: all of them.
    rope_layers: list[bool] = field(default_factory=list)
    # Leading values of each head that RoPE rotates (Phi-4-mini: 96 of 128); None: all of them.
    rope_dims: int | None = None
    # A mixture of experts in every block's MLP (0 experts: a dense MLP): how many, how many each token uses, each
    # expert's hidden width, and whether the chosen experts' weights are renormalized to sum 1.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    expert_normalize: bool = False
    shared_expert_ffn: int = 0  # a shared expert's hidden width (Qwen2-MoE), 0 for none
    # Llama 4's attention temperature (Ministral 3): queries scaled by 1 + t * log(1 + floor(position / length))
    attn_temperature: float = 0.0
    attn_temperature_length: int = 0
    # Gemma 4's sliding-window layers' own head size and KV heads (None: head_dim and num_kv_heads, as every layer)
    sliding_head_dim: int | None = None
    sliding_kv_heads: int | None = None
    # Gemma 4 E2B / E4B: the last `shared_kv_layers` layers compute no keys or values and attend over the cache of the
    # last earlier layer of their kind; each layer takes a per-layer input of `per_layer_input` values (0: none);
    # each layer's MLP width where they differ (empty: intermediate_size for all)
    shared_kv_layers: int = 0
    per_layer_input: int = 0
    layer_ffn: list[int] = field(default_factory=list)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def layer_head_dim(self, layer: int) -> int:
        return self.sliding_head_dim if self.sliding_head_dim and self.is_sliding(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.sliding_kv_heads if self.sliding_kv_heads and self.is_sliding(layer) else self.num_kv_heads

    def layer_intermediate(self, layer: int) -> int:
        return self.layer_ffn[layer] if self.layer_ffn else self.intermediate_size

    def kv_source(self, layer: int) -> int | None:
        """The earlier layer whose keys and values `layer` attends over (the last one of its kind before the shared
        ones), or None where it computes its own."""
        first_shared = self.num_layers - self.shared_kv_layers
        if layer < first_shared:
            return None
        kind = self.is_sliding(layer)
        return next((i for i in range(first_shared - 1, -1, -1) if self.is_sliding(i) == kind), None)

    def has_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]


# Sane bounds: far above any released model, far below what would let a forged file ask for terabytes
# (a sliding-window KV ring is allocated whole, per layer and per session).
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 18),
    "num_layers": (1, 1024),
    "num_heads": (1, 1024),
    "num_kv_heads": (1, 1024),
    "head_dim": (2, 1024),
    "max_position": (1, 1 << 24),
    "sliding_window": (1, 1 << 16),
    "sliding_head_dim": (2, 1024),
    "sliding_kv_heads": (1, 1024),
    "shared_kv_layers": (0, 1023),
    "per_layer_input": (0, 1 << 14),
}
# Bounds of the mixture-of-experts numbers, checked where a model has experts.
EXPERT_LIMITS: dict[str, tuple[int, int]] = {
    "num_experts": (1, 1 << 12),
    "experts_per_token": (1, 1 << 12),
    "expert_ffn": (1, 1 << 18),
    "shared_expert_ffn": (0, 1 << 18),
}
# ModelConfig field -> (GGUF key under the architecture, config.json key), to name the key an error is about.
KEY_NAMES: dict[str, tuple[str, str]] = {
    "vocab_size": ("vocab_size", "vocab_size"),
    "hidden_size": ("embedding_length", "hidden_size"),
    "intermediate_size": ("feed_forward_length", "intermediate_size"),
    "num_layers": ("block_count", "num_hidden_layers"),
    "num_heads": ("attention.head_count", "num_attention_heads"),
    "num_kv_heads": ("attention.head_count_kv", "num_key_value_heads"),
    "head_dim": ("attention.key_length", "head_dim"),
    "max_position": ("context_length", "max_position_embeddings"),
    "sliding_window": ("attention.sliding_window", "sliding_window"),
    "rms_eps": ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
    "rope_theta": ("rope.freq_base", "rope_theta"),
    "rope_local_theta": ("rope.freq_base_swa", "rope_local_base_freq"),
    "layer_types": ("attention.sliding_window_pattern", "layer_types"),
    "rope_scaling": ("rope.scaling.type", "rope_scaling"),
    "final_softcap": ("final_logit_softcapping", "final_logit_softcapping"),
    "attn_softcap": ("attn_logit_softcapping", "attn_logit_softcapping"),
    "query_pre_attn_scalar": ("attention.key_length", "query_pre_attn_scalar"),
    "embedding_scale": ("embedding_scale", "embedding_multiplier"),
    "residual_scale": ("residual_scale", "residual_multiplier"),
    "attention_scale": ("attention.scale", "attention_multiplier"),
    "logit_scale": ("logit_scale", "logits_scaling"),
    "rope_layers": ("block_count", "no_rope_layers"),
    "rope_dims": ("rope.dimension_count", "partial_rotary_factor"),
    "num_experts": ("expert_count", "num_experts"),
    "experts_per_token": ("expert_used_count", "num_experts_per_tok"),
    "expert_ffn": ("expert_feed_forward_length", "moe_intermediate_size"),
    "shared_expert_ffn": ("expert_shared_feed_forward_length", "shared_expert_intermediate_size"),
    "sliding_head_dim": ("attention.key_length_swa", "head_dim"),
    "sliding_kv_heads": ("attention.head_count_kv", "num_key_value_heads"),
    "shared_kv_layers": ("attention.shared_kv_layers", "num_kv_shared_layers"),
    "per_layer_input": ("embedding_length_per_layer_input", "hidden_size_per_layer_input"),
    "layer_ffn": ("feed_forward_length", "intermediate_size"),
}
# rope_type -> the entries rope_inv_freq reads (runlm/pytorch/nn.py implements these and no others).
ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("original_max_position_embeddings",),
}
# optional entries: a positive number where present
ROPE_OPTIONAL: dict[str, tuple[str, ...]] = {
    "yarn": ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"),
    "longrope": ("factor", "attention_factor"),
}
SLIDING, FULL = "sliding_attention", "full_attention"


def alternating_layers(layers: int) -> list[str]:
    """Sliding-window attention in the even layers, full in the odd ones (Gemma 2, gpt-oss)."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(layers)]


def integer(value: Any, what: str, low: int = 0, high: int = (1 << 63) - 1) -> int:
    """`value` if it is an integer within [low, high]; strings, floats and booleans are refused, not converted."""
    if type(value) is not int:
        raise ModelLoadError(f"{what} is {_show(value)}, expected an integer")
    if not low <= value <= high:
        raise ModelLoadError(f"{what} is {value}, expected {low} to {high}")
    return value


def number(value: Any, what: str, positive: bool = True) -> float:
    """`value` as a float if it is a finite int or float (positive unless told); strings are refused."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelLoadError(f"{what} is {_show(value)}, expected a finite number")
    if positive and value <= 0:
        raise ModelLoadError(f"{what} is {value}, expected a positive number")
    return float(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_config(config: ModelConfig, where: str, source: str = "gguf", arch: str = "") -> ModelConfig:
    """Refuse numbers no model has before anything is allocated from them: ranges, divisibility, rope scalings.

    `source` "gguf" or "hf" picks how errors name the key (`{arch}.attention.head_count` / `num_attention_heads`).
    """

    def key(name: str) -> str:
        gguf_key, hf_key = KEY_NAMES.get(name, (name, name))
        return f"{arch}.{gguf_key}" if source == "gguf" else f"config.json {hf_key}"

    def fail(name: str, message: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: {key(name)} {message}")

    for name, (low, high) in LIMITS.items():
        value = getattr(config, name)
        if not (name in ("sliding_window", "sliding_head_dim", "sliding_kv_heads") and value is None):
            integer(value, f"{where}: {key(name)}", low, high)
    if config.num_experts:
        for name, (low, high) in EXPERT_LIMITS.items():
            integer(getattr(config, name), f"{where}: {key(name)}", low, high)
        if config.experts_per_token > config.num_experts:
            raise fail("experts_per_token", f"is {config.experts_per_token}, more than the {config.num_experts} "
                                            f"experts")
    for name in ("num_kv_heads", "sliding_kv_heads"):
        if getattr(config, name) and config.num_heads % getattr(config, name):
            raise fail(name, f"is {getattr(config, name)}, expected a divisor of the {config.num_heads} heads")
    for name in ("head_dim", "sliding_head_dim"):
        if getattr(config, name) and getattr(config, name) % 2:
            raise fail(name, f"is {getattr(config, name)}, expected an even head size (RoPE rotates pairs)")
    if not 0 < number(config.rms_eps, f"{where}: {key('rms_eps')}") < 1:
        raise fail("rms_eps", f"is {config.rms_eps}, expected a small positive number")
    number(config.rope_theta, f"{where}: {key('rope_theta')}")
    for name in ("rope_local_theta", "query_pre_attn_scalar", "final_softcap", "attn_softcap", "embedding_scale",
                 "residual_scale", "attention_scale", "logit_scale"):
        if getattr(config, name) is not None:
            number(getattr(config, name), f"{where}: {key(name)}")
    if config.rope_dims is not None:
        if config.rope_dims < 2 or config.rope_dims % 2 or config.rope_dims > config.head_dim:
            raise fail("rope_dims", f"gives {config.rope_dims} rotated values per head of {config.head_dim}, expected "
                                    f"an even number up to it")
    for scaling in (config.rope_scaling, config.local_rope_scaling):
        check_rope_scaling(scaling, f"{where}: {key('rope_scaling')}")
    longrope = [s for s in (config.rope_scaling, config.local_rope_scaling) if s and s.get("rope_type") == "longrope"]
    for scaling in longrope:
        pairs = (config.rope_dims or config.head_dim) // 2
        for entry in ("short_factor", "long_factor"):
            factors = scaling.get(entry)
            if not isinstance(factors, list) or len(factors) != pairs:
                raise fail("rope_scaling", f"longrope {entry} must list {pairs} numbers, one per rotated pair")
            for value in factors:
                number(value, f"{where}: {key('rope_scaling')} longrope {entry}")
    if config.rope_layers and len(config.rope_layers) != config.num_layers:
        raise fail("rope_layers", f"gives {len(config.rope_layers)} layers' RoPE for {config.num_layers} layers")
    if config.shared_kv_layers >= config.num_layers:
        raise fail("shared_kv_layers", f"is {config.shared_kv_layers}, leaving none of the {config.num_layers} layers "
                                       f"to compute keys and values")
    if config.layer_ffn:
        if len(config.layer_ffn) != config.num_layers:
            raise fail("layer_ffn", f"gives {len(config.layer_ffn)} widths for {config.num_layers} layers")
        for width in config.layer_ffn:
            integer(width, f"{where}: {key('layer_ffn')}", *LIMITS["intermediate_size"])
    if config.layer_types:
        if len(config.layer_types) != config.num_layers:
            raise fail("layer_types", f"has {len(config.layer_types)} entries for {config.num_layers} layers")
        unknown = sorted({repr(t) for t in config.layer_types} - {repr(SLIDING), repr(FULL)})
        if unknown:
            raise fail("layer_types", f"holds {', '.join(unknown)}, expected {SLIDING!r} or {FULL!r}")
        if SLIDING in config.layer_types and config.sliding_window is None:
            raise fail("sliding_window", "is missing, but some layers use sliding-window attention")
    for layer in range(config.num_layers - config.shared_kv_layers, config.num_layers):
        if config.kv_source(layer) is None:
            raise fail("shared_kv_layers", f"leaves layer {layer} no earlier layer of its kind to share keys with")
    return config


def check_rope_scaling(scaling: Any, what: str) -> None:
    """A rope scaling runlm implements, with every entry it reads a positive number; others are named and refused."""
    if scaling is None:
        return
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{what} is {_show(scaling)}, expected an object")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return
    if kind not in ROPE_SCALINGS:
        raise ModelLoadError(
            f"{what}: rope scaling {_show(kind)} is not supported (runlm implements: {', '.join(ROPE_SCALINGS)})"
        )
    for entry in ROPE_SCALINGS[kind]:
        number(scaling.get(entry), f"{what} {kind} {entry}")
    for entry in ROPE_OPTIONAL.get(kind, ()):
        if scaling.get(entry) is not None:
            number(scaling[entry], f"{what} {kind} {entry}")
    if kind == "llama3" and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
        raise ModelLoadError(f"{what}: llama3 low_freq_factor and high_freq_factor are equal, expected a range")


def expected_shapes(config: ModelConfig, qk_norm_whole: bool = False) -> Callable[[str], tuple[int, ...] | None]:
    """The shape each shared-layer weight must have under `config` (HF names; None: no rule), so a source can
    refuse a tensor that does not match the hyperparameters before its data is read (WeightSource.expect).
    `qk_norm_whole`: the family's q / k norms span the whole projections (FamilySpec.qk_norm_whole)."""
    hidden, heads = config.hidden_size, config.num_heads

    def table(layer: int) -> dict[str, tuple[int, ...]]:
        kv, hd = config.layer_kv_heads(layer), config.layer_head_dim(layer)
        ffn, ple = config.layer_intermediate(layer), config.per_layer_input
        return {
            "self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, hidden),
            "mlp.gate_up_proj.weight": (2 * ffn, hidden),
            "self_attn.q_proj.bias": (heads * hd,),
            "self_attn.k_proj.bias": (kv * hd,),
            "self_attn.v_proj.bias": (kv * hd,),
            "self_attn.q_proj.weight": (heads * hd, hidden),
            "self_attn.k_proj.weight": (kv * hd, hidden),
            "self_attn.v_proj.weight": (kv * hd, hidden),
            "self_attn.o_proj.weight": (hidden, heads * hd),
            "self_attn.q_norm.weight": (heads * hd,) if qk_norm_whole else (hd,),
            "self_attn.k_norm.weight": (kv * hd,) if qk_norm_whole else (hd,),
            "mlp.gate_proj.weight": (ffn, hidden),
            "mlp.up_proj.weight": (ffn, hidden),
            "mlp.down_proj.weight": (hidden, ffn),
            "mlp.gate.weight": (config.num_experts, hidden),
            "mlp.gate.bias": (config.num_experts,),
            "mlp.shared_expert.gate_proj.weight": (config.shared_expert_ffn, hidden),
            "mlp.shared_expert.up_proj.weight": (config.shared_expert_ffn, hidden),
            "mlp.shared_expert.down_proj.weight": (hidden, config.shared_expert_ffn),
            "mlp.experts.gate_proj.bias": (config.num_experts, config.expert_ffn),
            "mlp.experts.up_proj.bias": (config.num_experts, config.expert_ffn),
            "mlp.experts.down_proj.bias": (config.num_experts, hidden),
            "self_attn.o_proj.bias": (hidden,),
            "self_attn.sinks.weight": (heads,),
            "mlp.experts.gate_proj.weight": (config.num_experts, config.expert_ffn, hidden),
            "mlp.experts.up_proj.weight": (config.num_experts, config.expert_ffn, hidden),
            "mlp.experts.down_proj.weight": (config.num_experts, hidden, config.expert_ffn),
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "pre_feedforward_layernorm.weight": (hidden,),
            "post_feedforward_layernorm.weight": (hidden,),
            "layer_scalar.weight": (1,),
            "mlp.experts.gate_up_proj.weight": (config.num_experts, 2 * config.expert_ffn, hidden),
            "mlp.experts.down_proj.scale": (config.num_experts,),
            "mlp.gate.scale": (hidden,),
            "pre_feedforward_layernorm_2.weight": (hidden,),
            "post_feedforward_layernorm_1.weight": (hidden,),
            "post_feedforward_layernorm_2.weight": (hidden,),
            "per_layer_input_gate.weight": (ple, hidden),
            "per_layer_projection.weight": (hidden, ple),
            "post_per_layer_input_norm.weight": (hidden,),
        }

    top = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "lm_head.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "rope_freqs.weight": (config.head_dim // 2,),
        # Gemma 4's per-layer inputs, every layer's side by side (GGUF names: there are no others)
        "per_layer_token_embd.weight": (config.vocab_size, config.num_layers * config.per_layer_input),
        "per_layer_model_proj.weight": (config.num_layers * config.per_layer_input, hidden),
        "per_layer_proj_norm.weight": (config.per_layer_input,),
    }

    def rule(name: str) -> tuple[int, ...] | None:
        if name in top:
            return top[name]
        parts = name.split(".", 3)
        if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            layer = int(parts[2])
            return table(layer).get(parts[3]) if layer < config.num_layers else None
        return None

    return rule


def hf_rope(config: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json in either the transformers 4 or 5 layout."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return number(params["rope_theta"], "config.json rope_parameters rope_theta"), scaling
    scaling = config.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return number(config.get("rope_theta", 10000.0), "config.json rope_theta"), scaling or None


def default_attention_scale(config: ModelConfig) -> float:
    if config.attention_scale is not None:
        return config.attention_scale
    return 1.0 / math.sqrt(config.query_pre_attn_scalar or config.head_dim)


def gguf_int(gguf, key: str, default: int | None = None) -> int:
    """An integer `{architecture}.{key}`; a string, float or missing value (without default) is refused."""
    value = gguf.arch_value(key, default)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata lacks {gguf.architecture}.{key}")
    return integer(value, f"{gguf.path}: {gguf.architecture}.{key}")


def gguf_float(gguf, key: str, default: float | None = None) -> float | None:
    """A positive number `{architecture}.{key}`, or `default` when absent."""
    value = gguf.arch_value(key)
    return default if value is None else number(value, f"{gguf.path}: {gguf.architecture}.{key}")


def gguf_rope_scaling(gguf) -> dict | None:
    """llama.cpp's rope.scaling.*: linear and YaRN are implemented; the others are named and refused, not ignored.

    (llama3 scaling reaches runlm as the `rope_freqs` tensor, with no scaling type.)"""
    kind = gguf.arch_value("rope.scaling.type")
    if kind in (None, "none"):
        return None
    where = f"{gguf.path}: {gguf.architecture}.rope.scaling.type"
    if kind == "linear":
        return {"rope_type": "linear", "factor": gguf_float(gguf, "rope.scaling.factor", 1.0)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": gguf_float(gguf, "rope.scaling.factor"),
                   "original_max_position_embeddings": gguf_int(gguf, "rope.scaling.original_context_length")}
        for entry, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                           ("attention_factor", "yarn_attn_factor"), ("mscale_all_dim", "yarn_log_multiplier")):
            if (value := gguf_float(gguf, f"rope.scaling.{key}")) is not None:
                scaling[entry] = value
        if "mscale_all_dim" in scaling:  # llama.cpp stores only it: the mscale it divides is 1
            scaling["mscale"] = 1.0
        if gguf.arch_value("rope.scaling.yarn_ext_factor") not in (None, 1.0):
            raise ModelLoadError(f"{where}: yarn_ext_factor {gguf.arch_value('rope.scaling.yarn_ext_factor')} is not "
                                 f"supported (runlm implements 1)")
        return scaling
    raise ModelLoadError(f"{where}: rope scaling {_show(kind)} is not supported (runlm implements: linear, yarn)")


def gguf_common_config(gguf, num_kv_heads: int | None = None, intermediate_size: int | None = None) -> dict[str, Any]:
    """The ModelConfig fields every llama.cpp architecture writes the same way (ranges: check_config).
    `num_kv_heads`, `intermediate_size`: where the family reads attention.head_count_kv or feed_forward_length itself
    (lists per layer: Gemma 4)."""
    heads = gguf_int(gguf, "attention.head_count")
    hidden = gguf_int(gguf, "embedding_length")
    integer(heads, f"{gguf.path}: {gguf.architecture}.attention.head_count", *LIMITS["num_heads"])
    vocab = gguf.arch_value("vocab_size")
    if vocab is None and gguf.has("token_embd.weight"):  # the embedding's rows, from the header
        vocab = gguf.raw("token_embd.weight").shape[0]
    if vocab is None:
        tokens = gguf.metadata.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if isinstance(tokens, list) and tokens else None
    if vocab is None:
        raise ModelLoadError(f"{gguf.path}: cannot tell the vocabulary size")
    head_dim = gguf_int(gguf, "attention.key_length", hidden // heads)
    rope_dims = gguf.arch_value("rope.dimension_count")
    if rope_dims is not None:
        rope_dims = integer(rope_dims, f"{gguf.path}: {gguf.architecture}.rope.dimension_count")
    return dict(
        vocab_size=integer(vocab, f"{gguf.path}: {gguf.architecture}.vocab_size"),
        hidden_size=hidden,
        intermediate_size=intermediate_size or gguf_int(gguf, "feed_forward_length"),
        num_layers=integer(gguf_int(gguf, "block_count"), f"{gguf.path}: {gguf.architecture}.block_count",
                           *LIMITS["num_layers"]),
        num_heads=heads,
        num_kv_heads=num_kv_heads or gguf_int(gguf, "attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_eps=gguf_float(gguf, "attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=gguf_float(gguf, "rope.freq_base", 10000.0),
        max_position=gguf_int(gguf, "context_length", 4096),
        rope_scaling=gguf_rope_scaling(gguf),
        tie_embeddings=not gguf.has("output.weight"),
        rope_dims=None if rope_dims in (None, head_dim) else rope_dims,
    )


def gguf_experts(gguf, normalize: bool = False, required: bool = True) -> dict[str, Any]:
    """A mixture of experts' numbers as llama.cpp writes them (ModelConfig's num_experts ...); `normalize`: whether
    the chosen experts' weights are renormalized where the file does not say. Not `required`: none (a dense model)
    where the file names no experts (llama's architecture holds Mixtral's experts, or none)."""
    if not required and gguf.arch_value("expert_count") in (None, 0):
        return {}
    normalized = gguf.arch_value("expert_weights_norm", normalize)
    if not isinstance(normalized, bool):
        raise ModelLoadError(f"{gguf.path}: {gguf.architecture}.expert_weights_norm is {_show(normalized)}, expected "
                             f"a bool")
    return dict(num_experts=gguf_int(gguf, "expert_count"), experts_per_token=gguf_int(gguf, "expert_used_count"),
                # Mixtral's files give the experts' width as the feed-forward length
                expert_ffn=gguf_int(gguf, "expert_feed_forward_length", gguf_int(gguf, "feed_forward_length")),
                expert_normalize=normalized,
                shared_expert_ffn=gguf_int(gguf, "expert_shared_feed_forward_length", 0))


def hf_experts(cfg: dict, ffn_key: str = "moe_intermediate_size") -> dict[str, Any]:
    """A mixture of experts' numbers from config.json (either spelling of the expert count)."""
    return dict(num_experts=hf_int(cfg, "num_experts" if "num_experts" in cfg else "num_local_experts"),
                experts_per_token=hf_int(cfg, "num_experts_per_tok"), expert_ffn=hf_int(cfg, ffn_key),
                expert_normalize=cfg.get("norm_topk_prob") is True,
                shared_expert_ffn=hf_int(cfg, "shared_expert_intermediate_size", 0))


def hf_int(cfg: dict, key: str, default: int | None = None) -> int:
    """An integer config.json entry; a string or float is refused (`"9"` is not nine heads)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"config.json lacks {key!r}")
        return default
    return integer(value, f"config.json {key}")


def hf_common_config(cfg: dict) -> dict[str, Any]:
    """The ModelConfig fields config.json spells the same way across families (ranges: check_config)."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"config.json: expected an object, got {type(cfg).__name__}")
    heads = integer(hf_int(cfg, "num_attention_heads"), "config.json num_attention_heads", *LIMITS["num_heads"])
    hidden = hf_int(cfg, "hidden_size")
    theta, scaling = hf_rope(cfg)
    head_dim = hf_int(cfg, "head_dim", hidden // heads)
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    partial = number(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)),
                     "config.json partial_rotary_factor")
    if isinstance(scaling, dict):
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
        if scaling.get("rope_type", scaling.get("type")) in ("llama3", "yarn", "longrope"):
            # as transformers reads it: a top-level original context first, then the scaling's, then the context
            original = cfg.get("original_max_position_embeddings")
            if original is not None:
                scaling["original_max_position_embeddings"] = original
            scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    tie = cfg.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise ModelLoadError(f"config.json tie_word_embeddings is {_show(tie)}, expected true or false")
    return dict(
        vocab_size=hf_int(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=hf_int(cfg, "intermediate_size"),
        num_layers=integer(hf_int(cfg, "num_hidden_layers"), "config.json num_hidden_layers", *LIMITS["num_layers"]),
        num_heads=heads,
        num_kv_heads=hf_int(cfg, "num_key_value_heads", heads),
        head_dim=head_dim,
        rms_eps=number(cfg.get("rms_norm_eps", 1e-6), "config.json rms_norm_eps"),
        rope_theta=theta,
        max_position=hf_int(cfg, "max_position_embeddings", 4096),
        rope_scaling=scaling,
        tie_embeddings=tie,
        rope_dims=None if partial == 1.0 else int(head_dim * partial),
    )
