"""Gemma 3's image path: SigLIP vision tower, multimodal projector, preprocessing, prompt splicing.

An image becomes `mm_tokens_per_image` soft tokens in the text model's width:

    RGB bytes -> resize (PIL, the processor's resampling) -> rescale 1/255 -> normalize (mean / std)
    -> SigLIP: patch conv + position embeddings -> pre-LN encoder blocks -> post layernorm
    -> projector: average pooling of the patch grid -> RMSNorm (Gemma's 1 + w) -> matmul into the text width

Each `<start_of_image>` of the prompt expands to Gemma3Processor's block
(`\\n\\n<start_of_image>` + `<image_soft_token>` x N + `<end_of_image>\\n\\n`); the text embeddings
at the soft tokens are replaced by the projected image, and the image's tokens attend to each other
bidirectionally during the prefill (DecoderLM.forward_embeds' `image_group`). Decoding then continues
on the runner's ordinary cached path.

Weights come from a Hugging Face `Gemma3ForConditionalGeneration` directory or from llama.cpp's
mmproj GGUF (`clip.*` metadata, `v.*` / `mm.*` tensors, soft_emb_norm stored with the 1 added).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from tokenizers import Tokenizer as Backend
from torch import nn

from runlm.errors import (
    InvalidInputError,
    ModelLoadError,
    RunlmError,
    TokenizerError,
    UnsupportedArchitectureError,
)
from runlm.families.config import integer, number
from runlm.formats.gguf import GGUFFile, find_mmproj
from runlm.formats.safetensors import SafetensorsSource
from runlm.pytorch.nn import RMSNorm
from runlm.runner import ImageInput
from runlm.text import Tokenizer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
VISION_LIMIT = 1 << 16  # bound on image size, widths and depth: far above SigLIP's, far below a forged file's
PIL_BILINEAR = 2


@dataclass
class VisionConfig:
    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    mm_tokens_per_image: int
    text_hidden_size: int
    hidden_act: str = "gelu_pytorch_tanh"
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = PIL_BILINEAR

    def check(self, where: Any) -> None:
        patches = self.image_size // self.patch_size
        per_side = math.isqrt(self.mm_tokens_per_image)
        if (
            min(self.image_size, self.patch_size, self.hidden_size, self.num_heads, per_side) <= 0
            or max(self.image_size, self.hidden_size, self.intermediate_size, self.num_layers) > VISION_LIMIT
            or self.intermediate_size <= 0
            or not (0 < self.layer_norm_eps < 1)
            or per_side * per_side != self.mm_tokens_per_image
            or patches % per_side
            or self.hidden_size % self.num_heads
            or len(self.image_mean) != 3
            or len(self.image_std) != 3
        ):
            raise ModelLoadError(f"{where}: inconsistent vision config {self}")


# -- preprocessing ----------------------------------------------------------------------


def preprocess(image_input: ImageInput, config: VisionConfig) -> torch.Tensor:
    """Pixel values [1, 3, S, S] exactly as transformers' Gemma3 image processor (PIL backend) makes them."""
    image = Image.frombytes("RGB", (image_input.width, image_input.height), image_input.rgb)
    size = config.image_size
    if image.size != (size, size):
        image = image.resize((size, size), resample=config.resample)
    pixels = np.asarray(image)
    if config.do_rescale:  # as transformers: in float64, then down to float32
        pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        pixels = pixels.astype(np.float32)
    if config.do_normalize:
        mean = np.asarray(config.image_mean, dtype=np.float32)
        std = np.asarray(config.image_std, dtype=np.float32)
        pixels = (pixels - mean) / std
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))[None]


# -- the tower -------------------------------------------------------------------------


class LayerNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.float(), persistent=False)
        self.register_buffer("bias", bias.float(), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class BiasedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.float().contiguous(), persistent=False)
        self.register_buffer("bias", bias.float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class EncoderBlock(nn.Module):
    """SigLIP's pre-LN block: x + attn(ln1(x)), then x + fc2(gelu(fc1(ln2(x)))); attention is unmasked MHA."""

    def __init__(self, get: Callable[[str], torch.Tensor], prefix: str, config: VisionConfig):
        super().__init__()
        p, eps = prefix, config.layer_norm_eps
        self.ln1 = LayerNorm(get(p + "layer_norm1.weight"), get(p + "layer_norm1.bias"), eps)
        self.qkv = BiasedLinear(
            torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
            torch.cat([get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]),
        )
        self.out = BiasedLinear(get(p + "self_attn.out_proj.weight"), get(p + "self_attn.out_proj.bias"))
        self.ln2 = LayerNorm(get(p + "layer_norm2.weight"), get(p + "layer_norm2.bias"), eps)
        self.fc1 = BiasedLinear(get(p + "mlp.fc1.weight"), get(p + "mlp.fc1.bias"))
        self.fc2 = BiasedLinear(get(p + "mlp.fc2.weight"), get(p + "mlp.fc2.bias"))
        self.heads = config.num_heads
        self.approximate = "none" if config.hidden_act in ("gelu", "gelu_new_exact") else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head_dim), as SigLIP
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate=self.approximate))


class VisionModel(nn.Module):
    """SigLIP tower plus Gemma 3's projector: pixels [B, 3, S, S] -> soft tokens [B, mm_tokens, text_hidden]."""

    def __init__(self, config: VisionConfig, get: Callable[[str], torch.Tensor], norm_offset: float):
        super().__init__()
        self.config = config
        get = _shape_checked(get, config)
        patch_w = get("embeddings.patch_embedding.weight").float()
        expected = (config.hidden_size, 3, config.patch_size, config.patch_size)
        if tuple(patch_w.shape) != expected:
            raise ModelLoadError(f"patch embedding has shape {tuple(patch_w.shape)}, expected {expected}")
        self.register_buffer("patch_weight", patch_w, persistent=False)
        self.register_buffer("patch_bias", get("embeddings.patch_embedding.bias").float(), persistent=False)
        self.register_buffer("positions", get("embeddings.position_embedding.weight").float(), persistent=False)
        n_patches = (config.image_size // config.patch_size) ** 2
        if tuple(self.positions.shape) != (n_patches, config.hidden_size):
            shape, expected = tuple(self.positions.shape), (n_patches, config.hidden_size)
            raise ModelLoadError(f"position embedding has shape {shape}, expected {expected}")
        self.blocks = nn.ModuleList(EncoderBlock(get, f"encoder.layers.{i}.", config) for i in range(config.num_layers))
        self.post_ln = LayerNorm(get("post_layernorm.weight"), get("post_layernorm.bias"), config.layer_norm_eps)
        self.soft_norm = RMSNorm(get("mm_soft_emb_norm.weight"), config.layer_norm_eps, norm_offset)
        proj = get("mm_input_projection_weight").float()
        if tuple(proj.shape) != (config.hidden_size, config.text_hidden_size):
            raise ModelLoadError(
                f"projector has shape {tuple(proj.shape)}, expected {(config.hidden_size, config.text_hidden_size)} "
                "(vision width, text width): does the projector belong to this text model?"
            )
        self.register_buffer("projection", proj.contiguous(), persistent=False)

    def tower(self, pixels: torch.Tensor) -> torch.Tensor:
        """SigLIP's last hidden state [B, patches, hidden] (after the post layernorm)."""
        p = self.config.patch_size
        x = F.conv2d(pixels.float(), self.patch_weight, self.patch_bias, stride=p)
        x = x.flatten(2).transpose(1, 2) + self.positions
        for block in self.blocks:
            x = block(x)
        return self.post_ln(x)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        b, n, d = hidden.shape
        side = math.isqrt(n)
        grid = hidden.transpose(1, 2).reshape(b, d, side, side)
        kernel = side // math.isqrt(self.config.mm_tokens_per_image)
        pooled = F.avg_pool2d(grid, kernel_size=kernel, stride=kernel).flatten(2).transpose(1, 2)
        return self.soft_norm(pooled) @ self.projection

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.project(self.tower(pixels))


def _shape_checked(get: Callable[[str], torch.Tensor], config: VisionConfig) -> Callable[[str], torch.Tensor]:
    """`get`, refusing a tower weight whose shape does not match the vision config (a ModelLoadError naming it)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    block = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden),
        "self_attn.out_proj.weight": (hidden, hidden),
        "mlp.fc1.weight": (inter, hidden),
        "mlp.fc1.bias": (inter,),
        "mlp.fc2.weight": (hidden, inter),
    }

    def checked(name: str) -> torch.Tensor:
        tensor = get(name)
        leaf = name.split(".", 3)[3] if name.startswith("encoder.layers.") else name
        want = block.get(leaf, (hidden,) if leaf.endswith((".bias", "norm.weight", "norm1.weight", "norm2.weight"))
                         or leaf == "post_layernorm.weight" else None)
        if want is not None and tuple(tensor.shape) != want:
            raise ModelLoadError(f"vision tensor {name!r} has shape {list(tensor.shape)}, expected {list(want)}")
        return tensor

    return checked


# -- loading ----------------------------------------------------------------------------

_SIGLIP_DEFAULTS = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=224,
    patch_size=16,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
)


def _image_processor_config(directory: Path) -> dict:
    """preprocessor_config.json (Google's checkpoints), else processor_config.json's image_processor (transformers
    5's layout)."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = directory / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path}: invalid JSON ({exc})") from exc
        data = data.get(key) if key and isinstance(data, dict) else data
        if isinstance(data, dict):
            return data
    return {}


def vision_config_from_hf(config: dict, directory: Path, text_hidden: int) -> VisionConfig:
    """Config.json's vision_config (transformers writes only non-default values) plus preprocessor_config.json."""
    declared = config.get("vision_config") or {}
    if not isinstance(declared, dict):
        raise ModelLoadError(f"{directory}: config.json vision_config must be an object")
    vc = {**_SIGLIP_DEFAULTS, **declared}
    model_type = vc.get("model_type", "siglip_vision_model")
    if model_type not in ("siglip_vision_model", "siglip"):
        raise UnsupportedArchitectureError(f"{directory}: vision tower {model_type!r} is not supported (SigLIP only)")
    def size(key: str) -> int:
        return integer(vc[key], f"{directory}: config.json vision_config {key}", 1, VISION_LIMIT)

    vision = VisionConfig(
        image_size=size("image_size"),
        patch_size=size("patch_size"),
        hidden_size=size("hidden_size"),
        intermediate_size=size("intermediate_size"),
        num_layers=size("num_hidden_layers"),
        num_heads=size("num_attention_heads"),
        layer_norm_eps=number(vc["layer_norm_eps"], f"{directory}: config.json vision_config layer_norm_eps"),
        hidden_act=str(vc["hidden_act"]),
        mm_tokens_per_image=integer(config.get("mm_tokens_per_image", 256), f"{directory}: mm_tokens_per_image",
                                    1, VISION_LIMIT),
        text_hidden_size=text_hidden,
    )
    pre = _image_processor_config(directory)
    if pre:
        mean, std = pre.get("image_mean"), pre.get("image_std")
        if isinstance(mean, int | float):
            mean = [mean] * 3
        if isinstance(std, int | float):
            std = [std] * 3
        vision.image_mean = tuple(float(m) for m in mean) if mean else vision.image_mean
        vision.image_std = tuple(float(s) for s in std) if std else vision.image_std
        if pre.get("rescale_factor") is not None:
            vision.rescale_factor = float(pre["rescale_factor"])
        vision.do_rescale = pre.get("do_rescale") is not False
        vision.do_normalize = pre.get("do_normalize") is not False
        if isinstance(pre.get("resample"), int):
            vision.resample = int(pre["resample"])
    vision.check(directory)
    return vision


# Google's checkpoints nest SigLIP under vision_model.; transformers 5 saves it flat (and nests all under model.).
_HF_TOWER_PREFIXES = (
    "vision_tower.vision_model.",
    "model.vision_tower.vision_model.",
    "vision_tower.",
    "model.vision_tower.",
)
_HF_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def _hf_getter(source) -> Callable[[str], torch.Tensor] | None:
    """Tensor lookup by SigLIP / projector names in any of the checkpoint layouts; None without a tower."""
    tower = next((p for p in _HF_TOWER_PREFIXES if source.has(p + "post_layernorm.weight")), None)
    proj = next((p for p in _HF_PROJECTOR_PREFIXES if source.has(p + "mm_input_projection_weight")), None)
    if tower is None or proj is None:
        return None

    def get(name: str) -> torch.Tensor:
        return source.tensor((proj if name.startswith("mm_") else tower) + name)

    return get


def vision_from_hf(directory: Path, config: dict, text_hidden: int) -> VisionModel | None:
    """The vision tower of a Gemma3ForConditionalGeneration directory; None for a text-only checkpoint
    (no vision_config, or a config that kept it while the tower's weights were stripped)."""
    if not config.get("vision_config"):
        return None
    vision = vision_config_from_hf(config, directory, text_hidden)
    get = _hf_getter(SafetensorsSource(directory))
    return None if get is None else VisionModel(vision, get, norm_offset=1.0)


# llama.cpp's mmproj tensor names (gguf-py MODEL_TENSOR V_* / MM_*), by SigLIP / projector name.
_GGUF_TOP = {
    "embeddings.patch_embedding": "v.patch_embd",
    "embeddings.position_embedding": "v.position_embd",
    "post_layernorm": "v.post_ln",
    "mm_soft_emb_norm": "mm.soft_emb_norm",
}
_GGUF_BLOCK = {
    "layer_norm1": "ln1",
    "layer_norm2": "ln2",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.out_proj": "attn_out",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}


def mmproj_name(name: str) -> str:
    """llama.cpp's mmproj tensor name for a SigLIP / Gemma 3 projector parameter name."""
    if name == "mm_input_projection_weight":
        return "mm.input_projection.weight"
    module, _, leaf = name.rpartition(".")
    if module in _GGUF_TOP:
        return f"{_GGUF_TOP[module]}.{leaf}"
    parts = module.split(".")
    if parts[:2] == ["encoder", "layers"] and ".".join(parts[3:]) in _GGUF_BLOCK:
        return f"v.blk.{parts[2]}.{_GGUF_BLOCK['.'.join(parts[3:])]}.{leaf}"
    return name


def vision_from_mmproj(path: Path, text_hidden: int) -> VisionModel:
    """A Gemma 3 vision tower from llama.cpp's mmproj GGUF."""
    gguf = GGUFFile(path)
    meta = gguf.metadata
    if meta.get("general.architecture") != "clip":
        raise ModelLoadError(f"{path}: not a vision projector GGUF (general.architecture is not 'clip')")
    kind = meta.get("clip.vision.projector_type", meta.get("clip.projector_type"))
    if kind != "gemma3":
        raise UnsupportedArchitectureError(f"{path}: projector type {kind!r} is not supported (gemma3 only)")
    if meta.get("clip.has_vision_encoder") is False:
        raise ModelLoadError(f"{path}: the projector has no vision encoder")

    def need(key: str) -> int:
        value = meta.get(f"clip.vision.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: mmproj metadata lacks clip.vision.{key}")
        return integer(value, f"{path}: clip.vision.{key}", 1, VISION_LIMIT)

    def numbers(key: str) -> tuple[float, ...]:
        values = meta.get(f"clip.vision.{key}") or (0.5, 0.5, 0.5)
        if not isinstance(values, list | tuple):
            raise ModelLoadError(f"{path}: clip.vision.{key} is not an array")
        return tuple(number(v, f"{path}: clip.vision.{key}", positive=False) for v in values)

    image_size, patch_size = need("image_size"), need("patch_size")
    scale = integer(meta.get("clip.vision.projector.scale_factor") or 4, f"{path}: clip.vision.projector.scale_factor",
                    1, VISION_LIMIT)
    per_side = (image_size // patch_size) // scale
    vision = VisionConfig(
        image_size=image_size,
        patch_size=patch_size,
        hidden_size=need("embedding_length"),
        intermediate_size=need("feed_forward_length"),
        num_layers=need("block_count"),
        num_heads=need("attention.head_count"),
        layer_norm_eps=number(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6),
                              f"{path}: clip.vision.attention.layer_norm_epsilon"),
        mm_tokens_per_image=per_side * per_side,
        text_hidden_size=text_hidden,
        hidden_act="gelu_pytorch_tanh",  # clip.use_gelu: ggml's gelu is the tanh approximation
        image_mean=numbers("image_mean"),
        image_std=numbers("image_std"),
    )
    vision.check(path)
    projection_dim = meta.get("clip.vision.projection_dim")
    if projection_dim is not None and projection_dim != text_hidden:
        raise ModelLoadError(
            f"{path}: the projector feeds a text width of {projection_dim}, the model's is {text_hidden}"
        )
    # llama.cpp stores soft_emb_norm with Gemma's 1 already added.
    return VisionModel(vision, lambda name: gguf.tensor(mmproj_name(name)), norm_offset=0.0)


def attach_vision(loaded, mmproj: str | Path | None = None) -> None:
    """Give a loaded Gemma runner its vision tower when the model has one (Family.attach_vision).

    A projector found next to the model that does not load (another model's, or broken) is skipped."""
    runner, text_hidden = loaded.runner, loaded.config.hidden_size
    vision = None
    if mmproj is not None:
        path = Path(mmproj).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such vision projector file")
        vision = vision_from_mmproj(path, text_hidden)
    elif loaded.format == "safetensors":
        vision = vision_from_hf(loaded.path, loaded.metadata, text_hidden)
    elif loaded.format == "gguf":
        for candidate in find_mmproj(loaded.path):
            try:
                vision = vision_from_mmproj(candidate, text_hidden)
                break
            except RunlmError as exc:  # another model's projector, or a broken one: the text model still loads
                warnings.warn(f"skipping the vision projector {candidate.name} next to the model: {exc}",
                              RuntimeWarning, stacklevel=2)
    runner.attach_vision(vision, loaded.tokenizer)


# -- prompt splicing and generation -----------------------------------------------------------


def resolve_tokenizer(tokenizer: Any) -> Tokenizer:
    """The tokenizer for an image prompt: a Tokenizer as it is, or one loaded from a path."""
    if tokenizer is None:
        raise TokenizerError("no tokenizer: pass tokenizer= (a tokenizer.json file or directory)")
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    if not path.is_file():
        raise InvalidInputError(f"{path}: no such tokenizer file or directory")
    if path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    if path.name == "tokenizer.json":
        return Tokenizer.from_hf_dir(path.parent)
    try:
        backend = Backend.from_file(str(path))
    except Exception as exc:
        raise TokenizerError(f"{path}: cannot load tokenizer ({exc})") from exc
    return Tokenizer(backend, bos_id=None, eos_id=None, add_bos=False)


def expand_prompt(prompt: str, mm_tokens: int, bos_text: str | None = None) -> str:
    """The prompt with its image marker expanded as Gemma3Processor does; no marker: the image goes first."""
    if not isinstance(prompt, str):
        raise InvalidInputError(f"prompt must be a str, got {type(prompt).__name__}")
    for text in (SOFT, EOI):
        if text in prompt:
            raise InvalidInputError(f"the prompt may not contain {text}: write {BOI} where the image goes")
    count = prompt.count(BOI)
    if count > 1:
        raise InvalidInputError(f"the prompt has {count} {BOI} markers but one image was given")
    if count == 0:
        at = len(bos_text) if bos_text and prompt.startswith(bos_text) else 0
        prompt = prompt[:at] + BOI + prompt[at:]
    return prompt.replace(BOI, f"\n\n{BOI}{SOFT * mm_tokens}{EOI}\n\n")


def multimodal_ids(tokenizer, prompt: str, mm_tokens: int,
                   encode: Callable[[str], list[int]] | None = None) -> tuple[list[int], torch.Tensor]:
    """Token ids of the expanded prompt and their image groups (-1 for text, else the image's index).
    `encode` (text -> ids with the model's BOS) replaces the tokenizer's encoding of the expanded prompt."""
    if tokenizer.token_to_id(SOFT) is None or tokenizer.token_to_id(BOI) is None:
        raise TokenizerError(f"the tokenizer has no {BOI} / {SOFT} tokens: it is not a Gemma 3 vision tokenizer")
    bos_text = tokenizer.token_str(tokenizer.bos_id) if tokenizer.bos_id is not None else None
    text = expand_prompt(prompt, mm_tokens, bos_text)
    if encode is not None:
        ids = list(encode(text))
    elif bos_text and text.startswith(bos_text):
        ids = tokenizer.encode(text, add_bos=False)
    else:
        ids = tokenizer.encode(text)
    return ids, image_groups(tokenizer, ids, mm_tokens)


def image_groups(tokenizer, ids: Sequence[int], mm_tokens: int) -> torch.Tensor:
    """Each position's image (-1 for text, else the image's index); the ids must hold one image's soft tokens."""
    soft_id = tokenizer.token_to_id(SOFT)
    is_image = torch.tensor([i == soft_id for i in ids], dtype=torch.bool)
    if int(is_image.sum()) != mm_tokens:
        raise TokenizerError(f"the tokenizer does not keep {SOFT} whole: expected {mm_tokens} soft tokens")
    starts = is_image & ~torch.cat([torch.zeros(1, dtype=torch.bool), is_image[:-1]])
    return torch.where(is_image, torch.cumsum(starts.long(), 0) - 1, torch.full_like(is_image, -1, dtype=torch.long))


__all__ = [
    "VisionConfig",
    "VisionModel",
    "attach_vision",
    "expand_prompt",
    "mmproj_name",
    "preprocess",
    "vision_from_hf",
    "vision_from_mmproj",
]
