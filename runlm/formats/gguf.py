"""GGUF files through the `gguf` package's memory-mapped reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runlm.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: its GGUF type name, logical shape (rows, cols...) and raw bytes."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 view into the memory map for quantized types, typed array otherwise


class GGUFFile:
    """Metadata and tensors of one GGUF file; tensors stay memory-mapped until asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such model file")
        with self.path.open("rb") as handle:
            magic = handle.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
        try:
            from gguf import GGUFReader

            self._reader = GGUFReader(str(self.path), "r")
        except Exception as exc:  # the reader raises bare ValueError / IndexError on corrupt files
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file ({exc})") from exc
        self.metadata: dict[str, Any] = {name: _field_value(field) for name, field in self._reader.fields.items()}
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A `{architecture}.{key}` metadata value."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> RawTensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        # GGUF lists dimensions fastest-first; reverse to row-major (rows, cols).
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return RawTensor(name=name, type_name=tensor.tensor_type.name, shape=shape, data=tensor.data)

    def tensor(self, name: str):
        """The tensor dequantized to a float32 torch tensor of its logical shape."""
        from runlm.quant import dequantize

        raw = self.raw(name)
        try:
            return dequantize(raw.type_name, raw.data, raw.shape)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{self.path}: tensor {name!r} ({raw.type_name}) is corrupt: {exc}") from exc


def _field_value(field) -> Any:
    """Decode a reader field into plain Python (str, int, float, bool, list)."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        item_type = types[-1] if len(types) > 1 else None
        if item_type == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    if types[0] == GGUFValueType.BOOL:
        return bool(value)
    return value
