"""Gemma 3 text models: sandwich norms, (1 + w) RMSNorm, interleaved sliding/global attention."""

from __future__ import annotations

import math

import torch
from torch import nn

from runlm.errors import ModelLoadError
from runlm.loading import Family, register_family
from runlm.models.base import (
    CachedRunner,
    DecoderLM,
    GGUFSource,
    ModelConfig,
    WeightLoader,
    default_attention_scale,
    gguf_common_config,
    hf_common_config,
    hf_rope,
)
from runlm.nn import Attention, FullKVCache, GatedMLP, RMSNorm, Rope, RopeSpec, SlidingKVCache, rope_inv_freq

SLIDING, FULL = "sliding_attention", "full_attention"


class SandwichBlock(nn.Module):
    """Norms before and after both attention and MLP, as Gemma 2/3 do."""

    def __init__(self, norms: list[nn.Module], attn: Attention, mlp: GatedMLP):
        super().__init__()
        self.pre_attn, self.post_attn, self.pre_mlp, self.post_mlp = norms
        self.attn, self.mlp = attn, mlp

        self._native: dict | None = None  # the packed weights for the one-call C++ decode block, if it applies
        self._native_args: tuple | None = None  # its weight arguments, gathered once (attribute lookups cost)

    def _apply(self, fn, recurse=True):
        self._native, self._native_args = None, None  # .to() and friends replace the tensors
        return super()._apply(fn, recurse)

    def forward(self, h, positions, rope_tables, cache, start, image_group=None):
        if h.shape[0] == h.shape[1] == 1 and image_group is None and isinstance(cache, FullKVCache | SlidingKVCache):
            native = self._native_parts()
            if native and h.dtype == torch.float32 and h.device.type == "cpu":
                return self._decode_native(native, h, rope_tables, cache, start)
        h = h + self.post_attn(self.attn(self.pre_attn(h), positions, rope_tables, cache, start, image_group))
        return h + self.post_mlp(self.mlp(self.pre_mlp(h)))

    def _native_parts(self) -> dict:
        """Block and type ids of every projection, when all are runlm GGUF kernels (else empty)."""
        if self._native is None:
            from runlm.quant.kernels import GGUFLinear, available
            from runlm.quant.packed import ConcatLinear

            def parts(module) -> list | None:
                pieces = list(module.parts) if isinstance(module, ConcatLinear) else [module]
                return pieces if all(isinstance(p, GGUFLinear) for p in pieces) else None

            attn, mlp = self.attn, self.mlp
            qkv, gate_up = parts(attn.qkv), parts(mlp.gate_up)
            single = [parts(attn.o_proj), parts(mlp.down)]
            ok = available() and qkv and gate_up and all(p and len(p) == 1 for p in single) and attn.softcap is None
            self._native = {"qkv": qkv, "gate_up": gate_up, "o": single[0][0], "down": single[1][0]} if ok else {}
        return self._native

    def _decode_native(self, native: dict, h, rope_tables, cache, start: int) -> torch.Tensor:
        """The whole block for one token in one C++ call, on the full cache or the sliding-window ring."""
        attn = self.attn
        if isinstance(cache, SlidingKVCache):
            slot, length = start % cache.window, min(start + 1, cache.window)
            cache.pos[slot] = start
        else:
            cache.reserve(start + 1)
            slot, length = start, start + 1
        if self._native_args is None:
            qkv, gate_up, o, down = native["qkv"], native["gate_up"], native["o"], native["down"]
            weights = (
                [self.pre_attn.scale, self.post_attn.scale, self.pre_mlp.scale, self.post_mlp.scale],
                self.pre_attn.eps, attn.q_norm.scale, attn.k_norm.scale,
                [p.blocks for p in qkv], [p.type_id for p in qkv], [p.out_features for p in qkv],
                o.blocks, o.type_id,
                [p.blocks for p in gate_up], [p.type_id for p in gate_up], [p.out_features for p in gate_up],
                down.blocks, down.type_id,
            )  # fmt: skip
            self._native_args = (id(attn.rope), weights, (attn.n_heads, attn.n_kv_heads, attn.scale))
        rope, weights, heads = self._native_args
        cos, sin = rope_tables[rope]
        out = torch.ops.runlm.sandwich_decode_block.default(
            h, *weights, cos, sin, cache.k, cache.v, slot, length, *heads
        )
        cache.length = start + 1
        return out


def build(config: ModelConfig, weights: WeightLoader) -> DecoderLM:
    # llama.cpp stores Gemma norm weights with the 1 already added.
    offset = 0.0 if isinstance(weights.source, GGUFSource) else 1.0

    def norm(name: str) -> RMSNorm:
        return RMSNorm(weights.norm_weight(name), config.rms_eps, offset)

    global_rope = Rope(rope_inv_freq(RopeSpec.build(config.head_dim, config.rope_theta, config.rope_scaling)))
    local_theta = config.rope_local_theta or 10000.0
    local_rope = Rope(rope_inv_freq(RopeSpec.build(config.head_dim, local_theta, config.local_rope_scaling)))
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        sliding = config.is_sliding(i)
        attn = Attention(
            qkv=weights.linear([p + f"self_attn.{x}_proj.weight" for x in "qkv"]),
            o_proj=weights.linear([p + "self_attn.o_proj.weight"]),
            n_heads=config.num_heads,
            n_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rope=local_rope if sliding else global_rope,
            scale=default_attention_scale(config),
            q_norm=norm(p + "self_attn.q_norm.weight"),
            k_norm=norm(p + "self_attn.k_norm.weight"),
            window=config.sliding_window if sliding else None,
            softcap=config.attn_softcap,
        )
        mlp = GatedMLP(
            weights.linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            weights.linear([p + "mlp.down_proj.weight"]),
            activation="gelu_tanh",
        )
        names = [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ]
        layers.append(SandwichBlock([norm(p + n + ".weight") for n in names], attn, mlp))
    return DecoderLM(
        config,
        embed=weights.embedding("model.embed_tokens.weight"),
        layers=layers,
        norm=norm("model.norm.weight"),
        head=weights.linear(["model.embed_tokens.weight"]),
        ropes=[global_rope, local_rope],
        embed_scale=math.sqrt(config.hidden_size),
    )


class GemmaRunner(CachedRunner):
    family_name = "gemma"
    vision = None  # a runlm.models.vision.VisionModel when the model has a vision tower (set by runlm.load)

    def supports_multimodal(self) -> bool:
        return self.vision is not None

    def generate_multimodal(
        self, prompt, rgb, img_w, img_h, tokenizer, n_new, on_token=None, on_phase=None
    ) -> list[int]:
        from runlm.models.vision import generate_multimodal

        return generate_multimodal(self, prompt, rgb, img_w, img_h, tokenizer, n_new, on_token, on_phase)

    def prefill_multimodal(self, prompt, rgb, img_w, img_h, tokenizer=None, on_phase=None, all_positions=False):
        """Beyond the contract: the multimodal prefill alone (last or all positions' logits)."""
        from runlm.models.vision import prefill_multimodal

        return prefill_multimodal(self, prompt, rgb, img_w, img_h, tokenizer, on_phase, all_positions)


def _config_from_hf(cfg: dict) -> ModelConfig:
    text = cfg.get("text_config") or cfg
    common = hf_common_config(text)
    common["rope_theta"], common["rope_scaling"] = hf_rope(text, FULL)
    local_theta, local_scaling = hf_rope(text, SLIDING)
    if "rope_local_base_freq" in text:
        local_theta, local_scaling = float(text["rope_local_base_freq"]), None
    n = common["num_layers"]
    pattern = int(text.get("sliding_window_pattern") or 6)
    layer_types = text.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    return ModelConfig(
        **common,
        sliding_window=int(text.get("sliding_window") or 4096),
        layer_types=list(layer_types),
        rope_local_theta=local_theta,
        local_rope_scaling=local_scaling,
        query_pre_attn_scalar=float(text.get("query_pre_attn_scalar", 256)),
        final_softcap=text.get("final_logit_softcapping"),
        attn_softcap=text.get("attn_logit_softcapping"),
    )


def _config_from_gguf(gguf) -> ModelConfig:
    common = gguf_common_config(gguf)
    common["tie_embeddings"] = True
    n = common["num_layers"]
    pattern = gguf.arch_value("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ModelLoadError(f"{gguf.path}: sliding_window_pattern has {len(pattern)} entries for {n} layers")
        layer_types = [SLIDING if flag else FULL for flag in pattern]
    else:
        layer_types = [SLIDING if i % int(pattern) < int(pattern) - 1 else FULL for i in range(n)]
    hidden, heads = common["hidden_size"], common["num_heads"]
    # As llama.cpp does: 27B scales queries by hidden/heads, the other sizes by head_dim.
    scalar = hidden / heads if n == 62 else common["head_dim"]
    softcap = gguf.arch_value("final_logit_softcapping")
    return ModelConfig(
        **common,
        sliding_window=int(gguf.arch_value("attention.sliding_window", 4096)),
        layer_types=layer_types,
        rope_local_theta=float(gguf.arch_value("rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=float(scalar),
        final_softcap=float(softcap) if softcap else None,
    )


def _attach_vision(loaded, mmproj) -> None:
    from runlm.models.vision import attach_vision

    attach_vision(loaded, mmproj)


FAMILY = register_family(
    Family(
        name="gemma",
        gguf_architectures=("gemma3",),
        hf_model_types=("gemma3_text", "gemma3"),
        config_from_hf=_config_from_hf,
        config_from_gguf=_config_from_gguf,
        build=build,
        runner=GemmaRunner,
        gguf_overrides={"post_attention_layernorm": "post_attention_norm"},
        hf_prefixes=(("", ""), ("model.", "model.language_model."), ("", "language_model.")),
        builtin_chat_format="gemma",
        attach_vision=_attach_vision,
    )
)
