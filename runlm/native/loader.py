"""A GGUF model on the native runtime, with its tokenizer and chat template: what runlm.load returns there."""

from __future__ import annotations

import shutil
from pathlib import Path

from runlm import catalog
from runlm.errors import InvalidInputError, ModelLoadError
from runlm.formats.gguf import GGUFFile, quantization_of
from runlm.native.model import KV_TYPES, NativeModel, model_config
from runlm.native.runner import NativeLoaded, NativeRunner
from runlm.system import release_free_heap, steady_heap
from runlm.text import ChatTemplate, Tokenizer

# kv_type "auto": float16, as the PyTorch backend picks for quantized weights; float32 where the blocks' weights are
# float32 (float32_blocks)
AUTO_KV_TYPE = "f16"


def load_native(path: Path, kv_type: str = "auto", max_context: int | None = None, threads: int | None = None,
                catalog_name: str | None = None) -> NativeLoaded:
    """The model at `path` (a GGUF file) on the native runtime; NativeRefusal where it cannot run there."""
    if kv_type != "auto" and kv_type not in KV_TYPES:
        raise InvalidInputError(f"kv_type must be one of auto, {', '.join(KV_TYPES)}, got {kv_type!r}")
    if max_context is not None and max_context < 1:
        raise InvalidInputError(f"max_context must be positive, got {max_context}")
    steady_heap()  # the forwards' activation buffers stay on the heap between blocks (runlm.system)
    forget_converted_copies()
    gguf = GGUFFile(path)
    kv = kv_type if kv_type != "auto" else "f32" if float32_blocks(gguf) else AUTO_KV_TYPE
    spec, config = model_config(gguf)
    tokenizer = Tokenizer.from_gguf(gguf.metadata)  # before the weights: a vocabulary that does not fit fails first
    check_vocabulary(tokenizer, config.vocab_size, path)
    template = ChatTemplate.from_gguf(gguf.metadata)
    fmt = catalog.CATALOG[catalog_name].chat_format if catalog_name else spec.chat_format
    if template is None and fmt is not None:
        bos, eos = (None if i is None else tokenizer.token_str(i) for i in (tokenizer.bos_id, tokenizer.eos_id))
        template = ChatTemplate.builtin(fmt, bos, eos)
    gguf.forget_vocabulary()
    release_free_heap()  # the tokenizer's build scratch and the vocabulary's objects, before the weights come on top
    model = NativeModel(gguf, kv, threads, (spec, config), max_context)
    loaded = NativeLoaded(runner=NativeRunner(model), tokenizer=tokenizer, chat_template=template, path=Path(path),
                          quantization=quantization_of(gguf), config=model.config,
                          metadata={k: v for k, v in gguf.metadata.items() if not k.startswith("tokenizer.ggml.")})
    release_free_heap()  # what the build freed (the header's objects, the layout scratch) leaves the process
    return loaded


def float32_blocks(gguf: GGUFFile) -> bool:
    """Whether every matrix of the blocks is float32 (an F32 file): their results are transformers' to float rounding,
    which a float16 cache would round off."""
    return all(gguf.raw(name).type_name == "F32" for name in gguf.tensor_names()
               if name.startswith("blk.") and len(gguf.shape(name)) >= 2)


def forget_converted_copies() -> None:
    """Remove the converted copies of models ("lean images", about a GGUF's size each) that earlier versions of runlm
    kept under $RUNLM_HOME/lean/images: nothing reads them any more."""
    images = catalog.runlm_home() / "lean" / "images"
    if images.is_dir():
        shutil.rmtree(images, ignore_errors=True)


def check_vocabulary(tokenizer: Tokenizer, vocab_size: int, path: Path) -> None:
    """Every id the tokenizer can produce must have an embedding row (a padded embedding may have more)."""
    if tokenizer.vocab_size > vocab_size:
        raise ModelLoadError(
            f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary holds "
            f"{vocab_size}: ids past {vocab_size - 1} would have no embedding"
        )


__all__ = ["AUTO_KV_TYPE", "check_vocabulary", "float32_blocks", "forget_converted_copies", "load_native"]
