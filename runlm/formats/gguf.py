"""GGUF files: runlm's memory-mapped header reader, llama.cpp's tensor names, and a WeightSource over them."""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from runlm.errors import ModelLoadError
from runlm.formats import WeightSource
from runlm.quant.dequant import dequantize

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: its GGUF type name, logical shape (rows, cols...) and raw bytes."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 view into the memory map for quantized types, typed array otherwise


class GGUFFile:
    """Metadata and tensors of one GGUF file; tensor data stays memory-mapped.

    The header is parsed here rather than with `gguf.GGUFReader`, which builds a
    numpy view per array element and takes ~20 s on a 262k-token vocabulary; the
    tests check this parser against that reader.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such model file")
        with self.path.open("rb") as handle:
            magic = handle.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            self.metadata, self._tensors = _parse(self._map)
        except (struct.error, UnicodeDecodeError, ValueError, IndexError, OverflowError, KeyError) as exc:
            raise ModelLoadError(f"{self.path}: corrupt or truncated GGUF file ({exc})") from exc
        size = self._map.shape[0]
        for info in self._tensors.values():
            if info.offset + info.nbytes > size:
                raise ModelLoadError(
                    f"{self.path}: truncated GGUF file (tensor {info.name!r} ends at byte "
                    f"{info.offset + info.nbytes}, the file has {size})"
                )

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
        info = self._tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        data = self._map[info.offset : info.offset + info.nbytes]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        if info.type_name in _PLAIN_DTYPES:
            data = data.view(_PLAIN_DTYPES[info.type_name]).reshape(info.shape)
        else:
            data = data.reshape(rows, -1)
        return RawTensor(name=name, type_name=info.type_name, shape=info.shape, data=data)

    def tensor(self, name: str):
        """The tensor dequantized to a float32 torch tensor of its logical shape."""
        raw = self.raw(name)
        try:
            return dequantize(raw.type_name, raw.data, raw.shape)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path}: tensor {name!r}: {exc}") from exc


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # row-major
    offset: int
    nbytes: int


_PLAIN_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}
# GGUF metadata value types -> struct format (scalars); 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


_U64 = struct.Struct("<Q")


def _parse(buf: np.ndarray) -> tuple[dict[str, Any], dict[str, _TensorInfo]]:
    mem = memoryview(buf)
    pos = 4
    (version,) = struct.unpack_from("<I", mem, pos)
    pos += 4
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old (need 2 or later)")
    n_tensors, n_kv = struct.unpack_from("<QQ", mem, pos)
    pos += 16

    size, unpack_u64 = len(mem), _U64.unpack_from

    def read_str(at: int) -> tuple[str, int]:
        # kept lean: a vocabulary array calls this hundreds of thousands of times
        (length,) = unpack_u64(mem, at)
        end = at + 8 + length
        if end > size:
            raise ValueError("string runs past the end of the file")
        return str(mem[at + 8 : end], "utf-8", "replace"), end

    def read_value(vtype: int, at: int) -> tuple[Any, int]:
        if vtype == 8:
            return read_str(at)
        if vtype == 9:
            item_type, count = struct.unpack_from("<IQ", mem, at)
            at += 12
            if item_type == 8:
                items = []
                for _ in range(count):
                    item, at = read_str(at)
                    items.append(item)
                return items, at
            if item_type in _NUMPY:
                width = np.dtype(_NUMPY[item_type]).itemsize
                array = np.frombuffer(mem, dtype=_NUMPY[item_type], count=count, offset=at)
                return array.tolist(), at + width * count
            items = []
            for _ in range(count):
                item, at = read_value(item_type, at)
                items.append(item)
            return items, at
        fmt = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, mem, at)
        return value, at + struct.calcsize(fmt)

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (vtype,) = struct.unpack_from("<I", mem, pos)
        metadata[key], pos = read_value(vtype, pos + 4)

    infos = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (n_dims,) = struct.unpack_from("<I", mem, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", mem, pos + 4)
        pos += 4 + 8 * n_dims
        ggml_type, offset = struct.unpack_from("<IQ", mem, pos)
        pos += 12
        qtype = GGMLQuantizationType(ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims)) if dims else 1
        if count % block:
            raise ValueError(f"tensor {name!r}: {count} elements do not fill {qtype.name} blocks of {block}")
        infos.append((name, qtype.name, tuple(int(d) for d in reversed(dims)), offset, count // block * type_size))

    alignment = int(metadata.get("general.alignment", 32))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = {name: _TensorInfo(name, t, shape, data_start + off, n) for name, t, shape, off, n in infos}
    return metadata, tensors


# -- GGUF naming ---------------------------------------------------------------------------

_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str, overrides: dict[str, str] | None = None) -> str:
    """llama.cpp's tensor name for a transformers parameter name; unknown names pass through."""
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        module = ".".join(parts[3:-1])
        table = {**_GGUF_LAYER_NAMES, **(overrides or {})}
        if module in table:
            return f"blk.{parts[2]}.{table[module]}.{parts[-1]}"
    return hf_name


class GGUFSource(WeightSource):
    """A GGUF file read through a family's HF-name -> GGUF-name mapping."""

    def __init__(self, gguf, rename: Callable[[str], str], row_perm: Callable[[str], torch.Tensor | None]):
        self.gguf, self.rename, self.row_perm, self.path = gguf, rename, row_perm, gguf.path

    def has(self, name: str) -> bool:
        return self.gguf.has(self.rename(name))

    def raw(self, name: str):
        raw = self.gguf.raw(self.rename(name))
        perm = self.row_perm(name)
        if perm is None:
            return raw
        return RawTensor(raw.name, raw.type_name, raw.shape, raw.data.reshape(raw.shape[0], -1)[perm.numpy()])

    def tensor(self, name: str) -> torch.Tensor:
        raw = self.raw(name)
        try:
            return dequantize(raw.type_name, raw.data, raw.shape)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path}: tensor {raw.name!r}: {exc}") from exc
