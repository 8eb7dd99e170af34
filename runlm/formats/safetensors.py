"""Hugging Face safetensors directories (one file, or shards behind an index) as a WeightSource."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open

from runlm.errors import ModelLoadError
from runlm.formats import WeightSource


class SafetensorsSource(WeightSource):
    """A Hugging Face directory's safetensors shards (index or single file)."""

    def __init__(self, directory, prefix_candidates: Sequence[tuple[str, str]] = (("", ""),)):
        self.path = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"{directory}: no *.safetensors files")
        self._where: dict[str, Any] = {}
        for filename in files:
            if not (directory / filename).is_file():
                raise ModelLoadError(f"{directory}: shard {filename} listed in the index is missing")
            try:
                handle = safe_open(str(directory / filename), framework="pt")
            except Exception as exc:
                raise ModelLoadError(f"{directory / filename}: corrupt safetensors file ({exc})") from exc
            for key in handle.keys():
                self._where[key] = handle
        # (strip, add) turns a text-model name into this checkpoint's name (multimodal checkpoints nest it).
        self.prefix = next(
            (p for p in prefix_candidates if self._apply("model.embed_tokens.weight", p) in self._where), ("", "")
        )

    @staticmethod
    def _apply(name: str, prefix: tuple[str, str]) -> str:
        strip, add = prefix
        return add + name[len(strip) :] if name.startswith(strip) else name

    def _key(self, name: str) -> str:
        key = self._apply(name, self.prefix)
        return name if key not in self._where and name in self._where else key

    def has(self, name: str) -> bool:
        return self._key(name) in self._where

    def tensor(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key not in self._where:
            raise ModelLoadError(f"{self.path}: missing tensor {key!r}")
        return self._where[key].get_tensor(key).float()
