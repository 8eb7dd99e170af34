"""The family registry: each family module registers its spec; loaders look specs up by a file's architecture."""

from __future__ import annotations

import importlib
from pathlib import Path

from runlm.errors import UnsupportedArchitectureError
from runlm.families.spec import FamilySpec

_SPECS: dict[str, FamilySpec] = {}
# one module per family under runlm.families; each registers itself on import
_FAMILY_MODULES = ("llama", "mistral", "mistral3", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3",
                   "gemma4", "granite", "olmo2", "phi3", "smollm3", "gpt_oss")


def register(spec: FamilySpec) -> FamilySpec:
    _SPECS[spec.name] = spec
    return spec


def specs() -> dict[str, FamilySpec]:
    """Every family's spec, by name (the family modules imported first)."""
    for module in _FAMILY_MODULES:
        importlib.import_module(f"runlm.families.{module}")
    return _SPECS


def supported() -> str:
    every = specs().values()
    names = {a for s in every for a in s.gguf_architectures} | {t for s in every for t in s.hf_model_types}
    return ", ".join(sorted(names))


def for_gguf(arch: str, path: Path | str) -> FamilySpec:
    for spec in specs().values():
        if arch in spec.gguf_architectures:
            return spec
    raise UnsupportedArchitectureError(f"{path}: architecture {arch!r} is not supported (supported: {supported()})")


def for_hf(config: dict, path: Path | str) -> FamilySpec:
    model_type = config.get("model_type")
    text_type = (config.get("text_config") or {}).get("model_type")
    for spec in specs().values():
        if model_type in spec.hf_model_types or text_type in spec.hf_model_types:
            return spec
    names = config.get("architectures") or []
    raise UnsupportedArchitectureError(
        f"{path}: model_type {model_type!r} ({', '.join(names) or 'no architectures'}) is not supported "
        f"(supported: {supported()})"
    )


__all__ = ["for_gguf", "for_hf", "register", "specs", "supported"]
