"""The PyTorch backend's view of a family: its spec (runlm.families, the one description) and the runner class
that serves it here (a vision-capable family's runner takes an image tower)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runlm import families
from runlm.families.config import ModelConfig
from runlm.families.spec import FamilySpec
from runlm.pytorch.base import CachedRunner, DecoderLM, WeightLoader


@dataclass(frozen=True)
class Family:
    """A family spec with what the PyTorch backend builds from it."""

    spec: FamilySpec
    runner: type  # a CachedRunner subclass
    # (loaded model, mmproj path or None) -> None: give the runner its vision tower when the model has one.
    attach_vision: Callable[[Any, Path | None], None] | None = None

    def __getattr__(self, name: str) -> Any:  # name, config readers, prefixes...: the spec's
        return getattr(self.spec, name)

    @property
    def builtin_chat_format(self) -> str | None:
        return self.spec.chat_format

    @property
    def gguf_overrides(self) -> dict[str, str]:
        return self.spec.gguf_names

    def build(self, config: ModelConfig, weights: WeightLoader) -> DecoderLM:
        from runlm.pytorch.decoder import build_decoder

        return build_decoder(self.spec, config, weights)

    def gguf_row_perm(self, name: str, config: ModelConfig) -> torch.Tensor | None:
        order = self.spec.qk_rows_order(name, config)
        return None if order is None else torch.tensor(order)


def family(spec: FamilySpec) -> Family:
    if spec.vision:
        from runlm.pytorch.gemma3 import GemmaRunner
        from runlm.pytorch.vision import attach_vision

        return Family(spec, GemmaRunner, attach_vision)
    return Family(spec, CachedRunner)


def family_for_gguf(arch: str, path: Path) -> Family:
    return family(families.for_gguf(arch, path))


def family_for_hf(config: dict, path: Path) -> Family:
    return family(families.for_hf(config, path))


__all__ = ["Family", "family", "family_for_gguf", "family_for_hf"]
