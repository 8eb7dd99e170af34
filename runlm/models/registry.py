"""The family registry: each family module registers a Family here; loading looks families up here."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from runlm.errors import UnsupportedArchitectureError
from runlm.models.config import ModelConfig


@dataclass(frozen=True)
class Family:
    """How to recognise, configure and build one model family."""

    name: str
    gguf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    config_from_hf: Callable[[dict], ModelConfig]
    config_from_gguf: Callable[[Any], ModelConfig]
    build: Callable[..., Any]  # (ModelConfig, WeightLoader) -> DecoderLM
    runner: type  # a CachedRunner subclass
    gguf_overrides: dict[str, str] = field(default_factory=dict)
    # Rows of a GGUF tensor to reorder back to transformers' layout (llama.cpp permutes llama's Q/K).
    gguf_row_perm: Callable[[str, ModelConfig], torch.Tensor | None] = lambda name, cfg: None
    # (strip, add) name prefixes to try, for checkpoints that nest the text model.
    hf_prefixes: tuple[tuple[str, str], ...] = (("", ""),)
    builtin_chat_format: str | None = None
    # (loaded model, mmproj path or None) -> None: give the runner its vision tower when the model has one.
    attach_vision: Callable[[Any, Path | None], None] | None = None


FAMILIES: dict[str, Family] = {}
_FAMILY_MODULES = ("llama", "qwen3", "gemma3")


def register_family(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """Every family, after importing the family modules (each registers itself)."""
    for module in _FAMILY_MODULES:
        importlib.import_module(f"runlm.models.{module}")
    return FAMILIES


def supported() -> str:
    fams = families().values()
    return ", ".join(
        sorted({a for f in fams for a in f.gguf_architectures} | {t for f in fams for t in f.hf_model_types})
    )


def family_for_gguf(arch: str, path: Path) -> Family:
    for family in families().values():
        if arch in family.gguf_architectures:
            return family
    raise UnsupportedArchitectureError(f"{path}: architecture {arch!r} is not supported (supported: {supported()})")


def family_for_hf(config: dict, path: Path) -> Family:
    model_type = config.get("model_type")
    text_type = (config.get("text_config") or {}).get("model_type")
    for family in families().values():
        if model_type in family.hf_model_types or text_type in family.hf_model_types:
            return family
    names = config.get("architectures") or []
    raise UnsupportedArchitectureError(
        f"{path}: model_type {model_type!r} ({', '.join(names) or 'no architectures'}) is not supported "
        f"(supported: {supported()})"
    )


__all__ = ["FAMILIES", "Family", "families", "family_for_gguf", "family_for_hf", "register_family", "supported"]
