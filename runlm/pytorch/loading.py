"""Auto dispatch: format from the path, family from the metadata, a ready runner out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from runlm import catalog
from runlm.catalog import resolve_model
from runlm.errors import InvalidInputError, ModelLoadError
from runlm.families.config import check_config, expected_shapes
from runlm.formats.gguf import GGUFFile, GGUFSource, gguf_name, quantization_of
from runlm.formats.safetensors import SafetensorsSource
from runlm.native.build import Q8_0_VALUES
from runlm.native.loader import check_vocabulary
from runlm.pytorch import kernels
from runlm.pytorch.base import WeightLoader
from runlm.pytorch.int4 import Int4Linear
from runlm.pytorch.kernels import GGUFLinear
from runlm.pytorch.registry import Family, family_for_gguf, family_for_hf
from runlm.runner import LmRunner, ServedModel
from runlm.system import release_free_heap, steady_heap
from runlm.text import ChatTemplate, Tokenizer


@dataclass(kw_only=True)
class LoadedModel(ServedModel):
    """A model on the PyTorch backend: the served description, and how its family was recognised and built."""

    family_spec: Family
    runtime: str = "torch"


DTYPES = {
    # name: (dense weight / activation dtype, keep GGUF weights as stored for the kernels)
    "auto": (torch.float32, True),
    "f32": (torch.float32, False),
    "bf16": (torch.bfloat16, True),
}

# KV cache element types; "auto": see kv_dtype_for. torch.uint8 means q8_0: GGML's block_q8_0 bytes (runlm.pytorch.nn
# kv_row_width), which only the fused C++ blocks read and write (see q8_0_kv_refusal).
KV_TYPES = {"auto": None, "f32": torch.float32, "f16": torch.float16, "q8_0": torch.uint8}


def kv_dtype_for(kv_type: str, runner: LmRunner) -> torch.dtype:
    """The KV caches' element type. "auto" is float16 where the weights run quantized in float32 activations (the
    packed path: half the memory, and the quantized weights' own error dwarfs its rounding), else the activations'
    dtype: the float32 reference and float weights stay float32 throughout (exact against transformers)."""
    if kv_type != "auto":
        return KV_TYPES[kv_type]
    dtype = runner.model.dtype
    quantized = any(isinstance(m, GGUFLinear | Int4Linear) for m in runner.model.modules())
    return torch.float16 if quantized and dtype == torch.float32 else dtype


def q8_0_kv_refusal(loaded: LoadedModel, dtype_name: str, device: torch.device) -> str | None:
    """Why a q8_0 KV cache cannot serve this model (None when it can). Its blocks are quantized and read only by
    the fused C++ blocks (kernels.cpp, KvQ8Block); torch's attention, which every other route uses, cannot read
    them."""
    if device.type != "cpu":
        return f"runlm's C++ kernels run on the CPU only, not on {device.type}"
    if not kernels.available():
        return kernels.unavailable_reason() or "runlm's C++ kernels are not available"
    if dtype_name != "auto":
        return f"dtype {dtype_name!r} runs torch's attention; q8_0 needs the default dtype 'auto'"
    if loaded.runner.supports_multimodal():
        return "this model has a vision tower, and an image prompt's prefill runs on torch's attention"
    head_dim = loaded.config.head_dim
    if head_dim % Q8_0_VALUES:
        return f"the head dimension {head_dim} is not a multiple of {Q8_0_VALUES} (the values of a q8_0 block)"
    if not loaded.runner.model.fused_stack:
        return (f"not every block of this {loaded.format} model runs on the fused kernels (those need GGUF "
                f"quantized weights and no attention soft cap)")
    return None


def load(
    name_or_path: str | Path | None = None,
    dtype: str = "auto",
    max_context: int | None = None,
    mmproj: str | Path | None = None,
    device: str | None = None,
    swa_full: bool = False,
    kv_type: str = "auto",
) -> LoadedModel:
    """Load a GGUF file, a Hugging Face directory or a catalog model into a ready runner.

    `device` None picks "cuda" when PyTorch sees a GPU, else "cpu". runlm's packed kernels are
    CPU-only, so elsewhere weights are dequantized once (bf16 for "auto").

    dtype "f32" is the float32 reference; "auto" keeps GGUF weights as stored (packed). A vision
    tower is found by itself (an HF directory's vision_config, an mmproj*.gguf next to a GGUF)
    or given as `mmproj`, llama.cpp's vision projector GGUF. `swa_full` keeps every position in the
    caches of sliding-window layers (llama.cpp's --swa-full), so the prompt cache can reuse any prefix.
    `kv_type` is the KV caches' element type (`KV_TYPES`).
    """
    if dtype not in DTYPES:
        raise InvalidInputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if kv_type not in KV_TYPES:
        raise InvalidInputError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
    steady_heap()  # the forwards' activation buffers stay on the heap between blocks (runlm.system)
    try:
        target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        raise InvalidInputError(f"unknown device {device!r} (use cpu or cuda)") from exc
    if target.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' asked for, but PyTorch sees no CUDA GPU")
    dtype_name = dtype
    dtype, packed = DTYPES[dtype]
    if target.type != "cpu":
        dtype, packed = (torch.bfloat16 if dtype_name == "auto" else dtype), False
    catalog_name = name_or_path if isinstance(name_or_path, str) and name_or_path in catalog.CATALOG else None
    path = resolve_model(name_or_path)
    if path.is_dir():
        loaded = _load_hf(path, dtype, packed, max_context, swa_full)
    else:
        loaded = _load_gguf(path, dtype, packed, max_context, swa_full)
    if target.type != "cpu":
        loaded.runner.to_device(target)
    loaded.runner.kv_dtype = kv_dtype_for(kv_type, loaded.runner)
    if loaded.chat_template is None:
        spec = loaded.family_spec
        fmt = catalog.CATALOG[catalog_name].chat_format if catalog_name else spec.builtin_chat_format
        if fmt is not None:
            tok = loaded.tokenizer
            loaded.chat_template = ChatTemplate.builtin(fmt, tok.token_str(tok.bos_id), tok.token_str(tok.eos_id))
    if loaded.family_spec.attach_vision is not None:
        loaded.family_spec.attach_vision(loaded, mmproj)
    elif mmproj is not None:
        raise ModelLoadError(f"{path}: {loaded.family} models take no vision projector (mmproj)")
    if kv_type == "q8_0" and (refusal := q8_0_kv_refusal(loaded, dtype_name, target)) is not None:
        raise InvalidInputError(f"kv_type 'q8_0' cannot be used here: {refusal}")
    release_free_heap()  # what the build freed (the file's metadata, the formats' scratch) leaves the process
    return loaded


def _load_gguf(path: Path, dtype: torch.dtype, packed: bool, max_context: int | None, swa_full: bool) -> LoadedModel:
    gguf = GGUFFile(path)
    family = family_for_gguf(gguf.architecture, path)
    config = check_config(family.config_from_gguf(gguf), str(path), "gguf", gguf.architecture)
    tokenizer = Tokenizer.from_gguf(gguf.metadata)
    check_vocabulary(tokenizer, config.vocab_size, path)
    chat_template = ChatTemplate.from_gguf(gguf.metadata)
    gguf.forget_vocabulary()
    release_free_heap()  # the tokenizer's build scratch and the vocabulary's objects, before the weights come on top
    source = GGUFSource(
        gguf,
        rename=lambda name: gguf_name(name, family.gguf_overrides),
        row_perm=lambda name: family.gguf_row_perm(name, config),
        expect=expected_shapes(config, family.qk_norm_whole),
    )
    model = family.build(config, WeightLoader(source, dtype, packed))
    runner = family.runner(model, family.name, max_context, swa_full=swa_full)
    return LoadedModel(
        runner=runner,
        tokenizer=tokenizer,
        chat_template=chat_template,
        path=path,
        format="gguf",
        family_spec=family,
        config=config,
        quantization=quantization_of(gguf),
        metadata={k: v for k, v in gguf.metadata.items() if not k.startswith("tokenizer.ggml.")},
    )


def _load_hf(path: Path, dtype: torch.dtype, packed: bool, max_context: int | None, swa_full: bool) -> LoadedModel:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        config_dict = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ModelLoadError(f"{config_file}: invalid JSON ({exc})") from exc
    if not isinstance(config_dict, dict):
        raise ModelLoadError(f"{config_file}: expected a JSON object, got {type(config_dict).__name__}")
    family = family_for_hf(config_dict, path)
    config = check_config(family.config_from_hf(config_dict), str(config_file), "hf")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path}: no tokenizer.json")
    tokenizer = Tokenizer.from_hf_dir(path)
    check_vocabulary(tokenizer, config.vocab_size, path)
    source = SafetensorsSource(path, family.hf_prefixes, expect=expected_shapes(config, family.qk_norm_whole),
                               row_order=lambda name: family.spec.qk_rows_order(name, config, gguf=False))
    model = family.build(config, WeightLoader(source, dtype, packed=False))  # safetensors hold plain floats
    runner = family.runner(model, family.name, max_context, swa_full=swa_full)
    return LoadedModel(
        runner=runner,
        tokenizer=tokenizer,
        chat_template=ChatTemplate.from_hf_dir(path),
        path=path,
        format="safetensors",
        family_spec=family,
        config=config,
        quantization=str(dtype).removeprefix("torch."),
        metadata=config_dict,
    )
