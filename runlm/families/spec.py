"""What a model family is, as data: the one description both runtimes build from."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runlm.errors import ModelLoadError
from runlm.families.config import ModelConfig

NORM_PLACEMENTS = ("pre", "sandwich", "post")
# Tensors some checkpoints carry that no family here applies (biases beyond Q/K/V's): refused where present.
UNAPPLIED_TENSORS = ("self_attn.o_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
# The gated MLP's activations (the kernels' Activation, in this order): "swiglu_oai" is gpt-oss's clamped SwiGLU.
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")
# How a mixture of experts' router weighs the experts it picks (the kernels' ExpertGating, in this order): a softmax
# over every expert, the top k kept (Qwen3-MoE); or the top k logits, a softmax over just those (gpt-oss).
EXPERT_GATINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class FamilySpec:
    """One decoder-only family. The numbers of a model (sizes, RoPE bases, window, soft-caps) come from its file
    through the two config readers; everything here is what the family always does.

    - `norms`: "pre" (RMSNorm before attention and before the MLP: Llama, Qwen), "sandwich" (before and after
      each: Gemma 2/3) or "post" (after each only: OLMo 2).
    - `qk_norm`: an RMSNorm over each head of the queries and keys (Qwen3, Gemma 3); with `qk_norm_whole`, one over
      the whole query and key projections (OLMo 2).
    - `fused_qkv`, `fused_gate_up`: the checkpoint stores Q/K/V as one `qkv_proj` and gate/up as one `gate_up_proj`
      (Phi-3), which the runtimes take as they are.
    - `activation`: the gated MLP's, one of ACTIVATIONS.
    - `biases`: the family has biases on every projection (gpt-oss: o, the router, the experts'), applied where the
      file has them; otherwise only a Q/K/V bias is, and others are refused (UNAPPLIED_TENSORS).
    - `attention_sinks`: each query head has a sink logit that joins attention's softmax with no value (gpt-oss).
    - `norm_offset`: added to RMSNorm weights as Hugging Face stores them (Gemma's 1 + w); GGUF files store the sum.
    - `scale_embeddings`: embeddings are multiplied by sqrt(hidden) (Gemma).
    - `tied_head`: the LM head is always the embedding table; otherwise it is `output.weight` where the file has
      one.
    - `gguf_qk_interleaved`: llama.cpp's converter interleaved the rows of Q and K per head for its RoPE (Llama);
      runtimes rotate halves, so they put the rows back.
    - `gguf_names`: this family's llama.cpp tensor names where they differ from the common table.
    - `hf_prefixes`: (strip, add) name prefixes to try for checkpoints that nest the text model.
    - `chat_format`: the built-in chat template for files that carry none.
    - `vision`: the family can take a vision tower (an mmproj GGUF beside the model, or a HF vision config).
    - `experts`: where the file has experts, the MLP is a mixture of them, routed as EXPERT_GATINGS names; None: a
      dense MLP always. How many experts, how many a token uses and their width come from the file
      (ModelConfig.num_experts ...; none: a dense MLP).
    - `shared_expert`: beside the routed experts, one every token runs, its output scaled by a sigmoid of its own
      one-row gate (Qwen2-MoE).
    - `experts_beside_mlp`: where the file has experts, they run beside the dense MLP rather than in its place, each
      branch normed, the router reading the block's residual with its own scales (Gemma 4 26B-A4B).
    - `values_from_keys`: a layer the file gives no value projection takes its key projection's output (before the
      keys' norm and RoPE) as its values (Gemma 4's full-attention layers).
    - `value_norm`: an RMSNorm without weights over each value head (Gemma 4).
    - `layer_scalar`: each block's output, the whole residual stream, is multiplied by the block's `layer_scalar`
      where the file has one (Gemma 4).
    Sliding-window layers, their RoPE base, layers without RoPE, soft-caps, the attention scale, a Q/K/V bias and
    Granite's multipliers are read from the file into ModelConfig or from its tensors.
    """

    name: str
    gguf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    config_from_gguf: Callable[[Any], ModelConfig]
    config_from_hf: Callable[[dict], ModelConfig]
    norms: str = "pre"
    qk_norm: bool = False
    qk_norm_whole: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    activation: str = "silu"
    norm_offset: float = 0.0
    scale_embeddings: bool = False
    tied_head: bool = False
    gguf_qk_interleaved: bool = False
    gguf_names: dict[str, str] = field(default_factory=dict)
    hf_prefixes: tuple[tuple[str, str], ...] = (("", ""),)
    chat_format: str | None = None
    vision: bool = False
    experts: str | None = None
    shared_expert: bool = False
    experts_beside_mlp: bool = False
    biases: bool = False
    attention_sinks: bool = False
    values_from_keys: bool = False
    value_norm: bool = False
    layer_scalar: bool = False

    def __post_init__(self):
        if self.norms not in NORM_PLACEMENTS:
            raise ValueError(f"{self.name}: norms must be one of {NORM_PLACEMENTS}, not {self.norms!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{self.name}: activation must be one of {ACTIVATIONS}, not {self.activation!r}")
        if self.experts is not None and self.experts not in EXPERT_GATINGS:
            raise ValueError(f"{self.name}: experts must be one of {EXPERT_GATINGS}, not {self.experts!r}")

    @property
    def norm_names(self) -> tuple[str | None, ...]:
        """Each block's RMSNorms in the order they apply (Hugging Face names): two before attention and the MLP, or
        four before and after each, None where the family has none (post-norm blocks)."""
        if self.norms == "sandwich":
            return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")
        if self.norms == "post":
            return (None, "post_attention_layernorm", None, "post_feedforward_layernorm")
        return ("input_layernorm", "post_attention_layernorm")

    def embed_scale(self, config: ModelConfig) -> float | None:
        if config.embedding_scale is not None:
            return config.embedding_scale
        return math.sqrt(config.hidden_size) if self.scale_embeddings else None

    def head_name(self, has_lm_head: bool, config: ModelConfig) -> str:
        """The weight the LM head reads: the embedding where the head is tied or the file has no head of its own."""
        if self.tied_head or config.tie_embeddings or not has_lm_head:
            return "model.embed_tokens.weight"
        return "lm_head.weight"

    def qkv_names(self, prefix: str, kind: str = "weight") -> list[str]:
        """A block's Q/K/V projection weights (or biases), as the checkpoint names them."""
        if self.fused_qkv:
            return [f"{prefix}self_attn.qkv_proj.{kind}"]
        return [f"{prefix}self_attn.{x}_proj.{kind}" for x in "qkv"]

    def gate_up_names(self, prefix: str) -> list[str]:
        """A block's gate and up projection weights, gate first."""
        if self.fused_gate_up:
            return [f"{prefix}mlp.gate_up_proj.weight"]
        return [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"]

    def expert_names(self, prefix: str, kind: str = "weight") -> tuple[str, list[str], str]:
        """A block's router, and its experts' gate and up weights and down weight (each [experts, rows, cols]), or
        their biases."""
        experts = f"{prefix}mlp.experts."
        return f"{prefix}mlp.gate.{kind}", [experts + f"gate_proj.{kind}", experts + f"up_proj.{kind}"], (
            experts + f"down_proj.{kind}")

    def shared_expert_names(self, prefix: str) -> tuple[list[str], str, str]:
        """A block's shared expert: its gate and up weights, its down weight, and its one-row gate."""
        shared = f"{prefix}mlp.shared_expert."
        return [shared + "gate_proj.weight", shared + "up_proj.weight"], shared + "down_proj.weight", (
            f"{prefix}mlp.shared_expert_gate.weight")

    def describe(self, config: ModelConfig) -> list[tuple[str, str]]:
        """What this model does, as read from its spec and file (`runlm info` prints it)."""
        layers = config.num_layers
        qk = {False: "", True: ", q/k norms per head"}[self.qk_norm and not self.qk_norm_whole]
        qk += ", q/k norms over the projections" if self.qk_norm_whole else ""
        rope = f"theta {config.rope_theta:g}"
        if config.rope_scaling:
            rope += f", {config.rope_scaling.get('rope_type', config.rope_scaling.get('type'))} scaling"
        if config.rope_dims and config.rope_dims < config.head_dim:
            rope += f", {config.rope_dims} of {config.head_dim} values"
        if config.rope_local_theta is not None and config.layer_types:
            rope += f", theta {config.rope_local_theta:g} on sliding layers"
        unrotated = [i for i in range(layers) if not config.has_rope(i)]
        if unrotated:
            rope += f", none in layers {', '.join(map(str, unrotated))}"
        sliding = sum(config.is_sliding(i) for i in range(layers))
        attention = f"sliding window {config.sliding_window} in {sliding} of {layers} layers" if sliding else "full"
        if config.attn_softcap is not None:
            attention += f", soft cap {config.attn_softcap:g}"
        if config.attn_temperature:
            attention += (f", query temperature 1 + {config.attn_temperature:g} log(1 + position // "
                          f"{config.attn_temperature_length})")
        if config.shared_kv_layers:
            attention += f", the last {config.shared_kv_layers} layers reusing an earlier layer's keys and values"
        mlp = f"{self.activation} MLP"
        if config.layer_ffn and len(set(config.layer_ffn)) > 1:
            mlp += f" of {min(config.layer_ffn)} to {max(config.layer_ffn)} by layer"
        if config.per_layer_input:
            mlp += f", per-layer inputs of {config.per_layer_input}"
        if self.experts and config.num_experts:
            mlp = (f"{self.activation} mixture of {config.num_experts} experts of {config.expert_ffn}, "
                   f"{config.experts_per_token} per token ({self.experts}"
                   f"{', renormalized' if config.expert_normalize else ''})")
            if self.shared_expert:
                mlp += f", and a shared expert of {config.shared_expert_ffn}"
        rows = [
            ("architecture", f"{self.name}: {self.norms}-norm blocks{qk}, {mlp}"),
            ("rope", rope),
            ("attention", attention),
            ("head", "tied to the embedding" if self.tied_head or config.tie_embeddings else "its own"),
        ]
        scales = [f"{label} {value:g}" for label, value in (
            ("embedding", config.embedding_scale), ("attention", config.attention_scale),
            ("residual", None if config.residual_scale == 1.0 else config.residual_scale),
            ("logits 1/", config.logit_scale), ("final soft cap", config.final_softcap)) if value is not None]
        if scales:
            rows.append(("scales", ", ".join(scales)))
        return rows

    def refuse_unapplied(self, has: Callable[[str], bool], layer: int, where: object, config: ModelConfig) -> None:
        """Refuse a block whose file holds tensors runlm would not apply (a bias on o, gate, up or down), or partial
        RoPE with q/k norms (whose weights would need the rotated layout too): a model run without them would answer,
        wrongly."""
        if config.rope_dims and config.rope_dims < config.head_dim and self.qk_norm:
            raise ModelLoadError(f"{where}: partial RoPE with q/k norms is not supported")
        p = f"model.layers.{layer}."
        unapplied = [p + name for name in UNAPPLIED_TENSORS if has(p + name) and not self.biases]
        if unapplied:
            raise ModelLoadError(f"{where}: holds {', '.join(unapplied)}, which runlm does not apply")

    def qk_rows_order(self, name: str, config: ModelConfig, gguf: bool = True) -> list[int] | None:
        """For a Q or K weight or bias (or a fused Q/K/V one): the stored row to take for each row of the layout the
        runtimes rotate, which pairs value i of a head with value i + head_dim / 2 (None where that is the stored
        order). Two things move rows: llama.cpp's converter interleaved the pairs of a llama-style family (GGUF
        only), and partial RoPE (rope_dims < head_dim) pairs i with i + rope_dims / 2, so each head's rotated values
        are spread to the halves' fronts and the rest, which rotate by nothing, fill in behind them."""
        head = self._head_order(config, gguf)
        if head is None:
            return None
        q, kv, D = config.num_heads, config.num_kv_heads, config.head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            groups, rest = q, 0
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            groups, rest = kv, 0
        elif name.endswith(("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias")):
            groups, rest = q + kv, kv * D  # the values' rows stay as they are
        else:
            return None
        order = [h * D + i for h in range(groups) for i in head]
        return order + list(range(groups * D, groups * D + rest))

    def _head_order(self, config: ModelConfig, gguf: bool) -> list[int] | None:
        D = config.head_dim
        order = list(range(D))
        if gguf and self.gguf_qk_interleaved:
            half = D // 2  # stored value 2 * i + j holds half-split value j * half + i
            order = [2 * (t % half) + t // half for t in range(D)]
        rotated = config.rope_dims or D
        if rotated < D:
            h, half, m = rotated // 2, D // 2, (D - rotated) // 2
            source = ([*range(h), *range(rotated, rotated + m)]
                      + [*range(h, rotated), *range(rotated + m, D)])
            assert len(source) == D and half == h + m
            order = [order[s] for s in source]
        return None if order == list(range(D)) else order


__all__ = ["ACTIVATIONS", "EXPERT_GATINGS", "FamilySpec", "NORM_PLACEMENTS"]
