"""Hugging Face safetensors directories (one file, or shards behind an index) as a WeightSource."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from runlm.errors import ModelLoadError
from runlm.formats import ShapeRule, WeightSource


class SafetensorsSource(WeightSource):
    """A Hugging Face directory's safetensors shards (index or single file)."""

    def __init__(
        self, directory, prefix_candidates: Sequence[tuple[str, str]] = (("", ""),), expect: ShapeRule | None = None,
        row_order: Callable[[str], list[int] | None] | None = None,
    ):
        """`row_order(name)`: the stored row to take for each row a runtime reads (FamilySpec.qk_rows_order), or
        None to take them as stored."""
        self.path, self.expect, self.row_order = directory, expect, row_order
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = _indexed_shards(index)
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
        handle = self._where[key]
        try:
            if self.expect is not None:  # from the header, before the data is read
                self.check_shape(name, tuple(handle.get_slice(key).get_shape()), key)
            values = handle.get_tensor(key).float()
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors' own errors (a dtype it cannot read, data cut short)
            raise ModelLoadError(f"{self.path}: tensor {key!r} cannot be read ({exc})") from exc
        order = self.row_order(name) if self.row_order is not None else None
        return values if order is None else values[torch.tensor(order)]


def _indexed_shards(index: Path) -> list[str]:
    """The shard files an index names, each a plain file name inside the model directory.

    A name with a directory part (`../../etc/passwd`, `/abs/path`, `sub/x`) is refused: an index must not make
    runlm open files outside the directory it was given.
    """
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index}: not a safetensors index with a weight_map ({exc})") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelLoadError(f"{index}: weight_map must map tensor names to shard file names")
    files = sorted(set(weight_map.values()))
    for filename in files:
        if filename in ("", ".", "..") or Path(filename).name != filename or "\\" in filename:
            raise ModelLoadError(f"{index}: shard {filename!r} is not a file name inside the model directory")
    return files
