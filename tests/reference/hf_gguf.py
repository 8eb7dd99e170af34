"""transformers' own reading of a GGUF file (its tokenizer, its causal LM), kept on disk after the first time.

transformers converts a GGUF through the gguf package: ~30 s for Gemma 3's tokenizer and ~50 s for its weights on
a 2-core machine, every run. The converted reference is saved under $RUNLM_HOME/test-references, keyed by the
file's content and transformers' version, so later runs load it in seconds; what the tests compare against is
still what transformers made of the file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from runlm.catalog import runlm_home


@functools.cache
def _content_key(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()[:20]


def _cached_dir(path: Path, kind: str) -> Path:
    import transformers

    return runlm_home() / "test-references" / f"{path.name}-{_content_key(path)}-tf{transformers.__version__}" / kind


def _save_atomically(target: Path, save) -> None:
    """save(dir) into a fresh directory, renamed into place: a run cut short leaves no half-written reference."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        save(scratch)
        os.replace(scratch, target)
    except OSError:  # another run put it there first
        shutil.rmtree(scratch, ignore_errors=True)


def hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    cached = _cached_dir(path, "tokenizer")
    if not cached.is_dir():
        converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        _save_atomically(cached, converted.save_pretrained)
        return converted
    return AutoTokenizer.from_pretrained(str(cached))


def hf_causal_lm(path: Path):
    """The float32 model, in eval mode. transformers will not save_pretrained a model read from GGUF, so its
    config and weights are stored as they are (safetensors keeps tied weights tied)."""
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM

    cached = _cached_dir(path, "model")
    if not cached.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)

        def save(directory: Path) -> None:
            model.config.save_pretrained(directory)
            save_model(model, str(directory / "model.safetensors"))

        _save_atomically(cached, save)
        return model.eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(cached)), dtype=torch.float32)
    load_model(model, str(cached / "model.safetensors"))
    return model.eval()
