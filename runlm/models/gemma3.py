"""Gemma 3 text models: sandwich norms, (1 + w) RMSNorm, interleaved sliding/global attention."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from runlm.errors import ModelLoadError, UnsupportedOperationError
from runlm.formats.gguf import GGUFSource
from runlm.models import vision as vision_module
from runlm.models.base import CachedRunner, DecoderLM, WeightLoader
from runlm.models.config import (
    ModelConfig,
    default_attention_scale,
    gguf_common_config,
    gguf_float,
    gguf_int,
    hf_common_config,
    hf_int,
    hf_rope,
    integer,
    number,
)
from runlm.models.registry import Family, register_family
from runlm.models.vision import VisionModel
from runlm.nn import Attention, GatedMLP, RMSNorm, Rope, RopeSpec, SandwichBlock, rope_inv_freq
from runlm.runner import ImageInput, Session

SLIDING, FULL = "sliding_attention", "full_attention"


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
    """Gemma 3; with a vision tower (`attach_vision`) it also takes one image per prompt."""

    family_name = "gemma"

    def __init__(self, model: DecoderLM, max_context: int | None = None, swa_full: bool = False):
        super().__init__(model, max_context, swa_full)
        self.vision: VisionModel | None = None
        self.tokenizer = None  # the tokenizer image prompts are encoded with (given with the tower)

    def attach_vision(self, vision: VisionModel | None, tokenizer) -> None:
        self.vision, self.tokenizer = vision, tokenizer
        if vision is not None:
            vision.to(self.device)

    def to_device(self, device: torch.device) -> None:
        super().to_device(device)
        if self.vision is not None:
            self.vision.to(device)

    def supports_multimodal(self) -> bool:
        return self.vision is not None

    def image_marker(self) -> str | None:
        return vision_module.BOI if self.vision is not None else None

    def _require_vision(self) -> VisionModel:
        if self.vision is None:
            raise UnsupportedOperationError(
                "gemma model has no vision tower: this model cannot take images (load a Gemma 3 vision "
                "checkpoint, or pass mmproj= with llama.cpp's projector GGUF)"
            )
        return self.vision

    def multimodal_prompt_ids(self, prompt: str, tokenizer=None, encode=None) -> list[int]:
        mm_tokens = self._require_vision().config.mm_tokens_per_image
        tok = vision_module.resolve_tokenizer(tokenizer if tokenizer is not None else self.tokenizer)
        return vision_module.multimodal_ids(tok, prompt, mm_tokens, encode)[0]

    @torch.inference_mode()
    def prefill_multimodal(
        self, session: Session, prompt: str, image: ImageInput, on_phase=None, tokenizer=None,
        all_positions: bool = False, ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The image's soft tokens replace the text embeddings at its block, which attends bidirectionally."""
        vision = self._require_vision()
        tok = vision_module.resolve_tokenizer(tokenizer if tokenizer is not None else self.tokenizer)
        pixels = vision_module.preprocess(image, vision.config)
        mm_tokens = vision.config.mm_tokens_per_image
        if ids is None:
            ids, group = vision_module.multimodal_ids(tok, prompt, mm_tokens)
        else:
            ids = [int(i) for i in ids]
            group = vision_module.image_groups(tok, ids, mm_tokens)
        self.check_prompt(ids)
        self.check_fits(len(ids))
        if on_phase is not None:
            on_phase("vision")
        features = vision(pixels.to(self.device))[0]
        if on_phase is not None:
            on_phase("prefill")
        self.reset_session(session)
        h = self.model.embed_tokens(torch.tensor(ids, dtype=torch.long, device=self.device))[None]
        group = group.to(h.device)
        h[0, group >= 0] = features.to(h.dtype)
        logits = self.model.forward_embeds(h, session.state, 0, last_only=not all_positions, image_group=group)
        session.tokens = list(ids)
        return (logits if all_positions else logits[-1]).cpu()


def _config_from_hf(cfg: dict) -> ModelConfig:
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


def _config_from_gguf(gguf) -> ModelConfig:
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
        attach_vision=vision_module.attach_vision,
    )
)
