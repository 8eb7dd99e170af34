"""GGUF files: runlm's memory-mapped header reader, llama.cpp's tensor names, and a WeightSource over them."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runlm.errors import ModelLoadError, RunlmError
from runlm.formats import ShapeRule, WeightSource
from runlm.native.build import BLOCK_LAYOUTS, RUN_TYPES

if TYPE_CHECKING:  # the header reader imports without torch (runlm.native reads tokenizers with it)
    import torch

GGUF_MAGIC = b"GGUF"


class _FileReader:
    """A file read at offsets (pread), open for as long as a tensor read from it lives; `release` lets go of the pages
    of a byte range of its memory map `mapping` that a caller read through the map."""

    def __init__(self, path: Path, mapping: mmap.mmap | None = None):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.mapping = mapping

    def release(self, offset: int, nbytes: int) -> None:
        """Unmap the pages of bytes [offset, offset + nbytes) from the process (the page cache keeps them; a later
        touch maps them again), so what was read through the map does not stay resident.

        The pages wholly inside the range are also marked MADV_DONTDUMP, which gives them a VMA of their own: a fault
        maps the page cache's folio around it (large folios, up to 2 MiB) within its VMA, so the first reads of
        weights used in place beside a copied one mapped the copied one's pages back (Phi-4-mini IQ4_XS: 42 MiB of
        resident memory that held nothing in use)."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED") or nbytes <= 0:
            return
        end = min(offset + nbytes, len(self.mapping))
        start = offset - offset % mmap.PAGESIZE
        self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
        inner_start, inner_end = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE, end - end % mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTDUMP") and inner_end > inner_start:
            self.mapping.madvise(mmap.MADV_DONTDUMP, inner_start, inner_end - inner_start)

    def read_into(self, offset: int, out: np.ndarray) -> None:
        view, done = memoryview(out).cast("B"), 0
        while done < len(view):  # preadv may return less than asked (Linux caps one call at ~2 GiB)
            count = os.preadv(self.fd, [view[done:]], offset + done)
            if count <= 0:
                raise ModelLoadError(f"{self.path}: the file ended at byte {offset + done} (changed while loading?)")
            done += count

    def __del__(self) -> None:
        if getattr(self, "fd", None) is not None:  # None: os.open failed
            os.close(self.fd)


@dataclass(frozen=True)
class RawTensor:
    """A tensor as stored: its GGUF type name, logical shape (rows, cols...) and raw bytes.

    `data` is a view of the file's memory map, for weights used in place (only the pages touched become resident).
    Copies go through `read_rows`, which reads the file with pread where the tensor is in one (`mapped`), or through
    `mapped_rows` followed by `release_rows`: every page touched through a map stays in the process's resident
    memory until it is released, so a load that copied weights out of `data` would hold the whole file beside its
    copy.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 view into the memory map for quantized types, typed array otherwise
    file: _FileReader | None = None  # where `data` lies, at `offset`; None: data is an array of its own
    offset: int = 0

    @property
    def mapped(self) -> bool:
        """Whether `data` is a view of a file's map (so a weight in the file's layout can be used without a copy)."""
        return self.file is not None

    def mapped_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as a view of the map (a `mapped` tensor's), for one pass over them: `release_rows`
        lets go of the pages the pass touched."""
        rows = math.prod(self.shape[:-1])
        return self.data.reshape(rows, -1).view(np.uint8)[start:stop]

    def release_rows(self, start: int, stop: int) -> None:
        if self.file is not None:
            row_bytes = self.data.nbytes // math.prod(self.shape[:-1])
            self.file.release(self.offset + start * row_bytes, (stop - start) * row_bytes)

    def read_rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """The bytes of rows [start, stop) (rows: all dimensions but the last), into `out` (contiguous, writable,
        exactly that many bytes) or a new uint8 array [stop - start, row_bytes]; never through the map."""
        rows = math.prod(self.shape[:-1])
        row_bytes = self.data.nbytes // rows if rows else 0
        if out is None:
            out = np.empty((stop - start, row_bytes), dtype=np.uint8)
        if self.file is not None:
            self.file.read_into(self.offset + start * row_bytes, out)
        else:
            np.copyto(out.reshape(stop - start, row_bytes), self.data.reshape(rows, -1).view(np.uint8)[start:stop])
        return out


    def expert(self, index: int) -> RawTensor:
        """Expert `index`'s matrix of a tensor of every expert's [experts, rows, cols]: its bytes, in place."""
        count = self.shape[0]
        if len(self.shape) != 3 or not 0 <= index < count:
            raise ModelLoadError(f"tensor {self.name!r} of shape {list(self.shape)} has no expert {index}")
        each = self.data.nbytes // count
        data = self.data.reshape(count, -1)[index]
        return RawTensor(f"{self.name}[{index}]", self.type_name, self.shape[1:], data, self.file,
                         self.offset + index * each)


SPLIT_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})(?P<ext>\.(?i:gguf))$")
MAX_SPLITS = 999  # llama.cpp's gguf-split names parts with five digits; no published model has near this many


class _Part:
    """One file of a model: its memory map, its pread reader and the tensors it holds."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"{path}: no such model file")
        try:
            with path.open("rb") as handle:
                magic = handle.read(4)
                if magic != GGUF_MAGIC:
                    raise ModelLoadError(f"{path}: not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
                # mmap rather than np.memmap: it can madvise (the header's pages go once the header is parsed)
                self.mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            _ask_for_huge_pages(self.mmap)
            self.map = np.frombuffer(self.mmap, dtype=np.uint8)
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read ({exc.strerror or exc})") from exc
        try:
            self.metadata, self.tensors = _parse(self.map)
        except (struct.error, ValueError) as exc:  # _Corrupt is a ValueError; struct.error: cut short
            raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({exc})") from exc
        size = self.map.shape[0]
        for info in self.tensors.values():
            if info.offset + info.nbytes > size:
                raise ModelLoadError(
                    f"{path}: truncated GGUF file (tensor {info.name!r} ends at byte "
                    f"{info.offset + info.nbytes}, the file has {size})"
                )
        header_bytes = min((info.offset for info in self.tensors.values()), default=size)
        if hasattr(mmap, "MADV_DONTNEED"):  # the header is now Python objects: its pages (the vocabulary) can go
            self.mmap.madvise(mmap.MADV_DONTNEED, 0, header_bytes)
        self.reader = _FileReader(path, self.mmap) if hasattr(os, "preadv") else None

    def split(self) -> tuple[int, int] | None:
        """(this part's index, the number of parts) where the file is one part of a split model (llama.cpp's
        gguf-split keys), else None."""
        count, number = self.metadata.get("split.count"), self.metadata.get("split.no")
        if count is None:
            return None
        if type(count) is not int or type(number) is not int or not 0 <= number < count <= MAX_SPLITS:
            raise ModelLoadError(f"{self.path}: split.no {number!r} / split.count {count!r} are not a part's numbers")
        return (number, count) if count > 1 else None


def split_parts(path: Path) -> list[Path]:
    """Every part of the split model whose part `path` is (named as llama.cpp's gguf-split names them:
    <prefix>-00001-of-00003.gguf), in order; [path] for a file that is not a part by its name."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    return [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}{match['ext']}") for i in range(1, count + 1)]


def _ask_for_huge_pages(mapping: mmap.mmap) -> None:
    """Ask the kernel to read the file into 2 MiB page-cache folios mapped whole (Linux, on file systems with large
    folios): the kernels walk the weights read in place, and in 4 KiB mappings their TLB misses cost. An Intel Xeon
    VM, gpt-oss-20b's shape with its MXFP4 experts in place, the file read cold: decode at 0.76x the speed of copied
    experts without this, 0.92x with it."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass


class GGUFFile:
    """Metadata and tensors of one GGUF model, in one file or split into parts (llama.cpp's gguf-split: opened by
    any part's path, joined here); tensor data stays memory-mapped.

    The header is parsed here rather than with `gguf.GGUFReader`, which builds a
    numpy view per array element and takes ~20 s on a 262k-token vocabulary; the
    tests check this parser against that reader.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        first = _Part(self.path)
        split = first.split()
        if split is None:
            self._parts = [first]
        else:
            self._parts = self._join(first, *split)
            self.path = self._parts[0].path
        self.metadata = self._parts[0].metadata
        self._tensors = {name: (index, info) for index, part in enumerate(self._parts)
                         for name, info in part.tensors.items()}

    def _join(self, opened: _Part, number: int, count: int) -> list[_Part]:
        """Every part of a split model, opened and checked: named by llama.cpp's convention, numbered in order,
        the tensors' count as the first part declares it, no tensor in two parts."""
        paths = split_parts(self.path)
        if len(paths) != count:
            raise ModelLoadError(f"{self.path}: part {number + 1} of {count} of a split model, but its name is not "
                                 f"<prefix>-0000N-of-{count:05d}.gguf as llama.cpp's gguf-split writes it")
        if paths[number] != self.path:
            raise ModelLoadError(f"{self.path}: not part {paths.index(self.path) + 1} of {count} of its split model: "
                                 f"it holds part {number + 1}")
        parts = [opened if i == number else _Part(p) for i, p in enumerate(paths)]
        for index, part in enumerate(parts):
            if part.split() != (index, count):
                raise ModelLoadError(f"{part.path}: not part {index + 1} of {count} of {paths[0].name}'s model "
                                     f"(its split keys: {part.split()})")
        names = [name for part in parts for name in part.tensors]
        if len(set(names)) != len(names):
            raise ModelLoadError(f"{paths[0]}: a tensor is in two parts of the split model")
        declared = parts[0].metadata.get("split.tensors.count")
        if declared is not None and declared != len(names):
            raise ModelLoadError(f"{paths[0]}: the split model declares {declared} tensors, its parts hold "
                                 f"{len(names)}")
        return parts

    @property
    def paths(self) -> list[Path]:
        """The model's files: one, or each part of a split model."""
        return [part.path for part in self._parts]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A `{architecture}.{key}` metadata value."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def forget_vocabulary(self) -> None:
        """Drop the vocabulary's arrays (tokens, merges, scores, token types) from the metadata, for a loader whose
        tokenizer and chat template are built: hundreds of thousands of Python objects (~30 MB for a 128k vocabulary)
        that would otherwise sit under the weights' copy at the load's peak."""
        for key in VOCABULARY_KEYS:
            self.metadata.pop(key, None)

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's logical shape, from the header alone."""
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        return self._tensors[name][1].shape

    def raw(self, name: str) -> RawTensor:
        if name not in self._tensors:
            raise ModelLoadError(f"{self.path}: missing tensor {name!r}")
        index, info = self._tensors[name]
        part = self._parts[index]
        data = part.map[info.offset : info.offset + info.nbytes]
        rows = math.prod(info.shape[:-1])
        if info.type_name in _PLAIN_DTYPES:
            data = data.view(_PLAIN_DTYPES[info.type_name]).reshape(info.shape)
        else:
            data = data.reshape(rows, info.nbytes // rows if rows else 0)
        return RawTensor(info.name, info.type_name, info.shape, data, part.reader, info.offset)

    def tensor(self, name: str):
        """The tensor dequantized to a float32 torch tensor of its logical shape."""
        return _dequantized(self.raw(name), self.path)


def _dequantized(raw: RawTensor, path: Path) -> torch.Tensor:
    """A float32 copy of a tensor, read without touching the map (see RawTensor)."""
    from runlm.pytorch.dequant import dequantize

    try:
        return dequantize(raw.type_name, raw.read_rows(0, math.prod(raw.shape[:-1])), raw.shape)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: tensor {raw.name!r}: {exc}") from exc


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
VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                   "tokenizer.ggml.token_type")

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
SUPPORTED_VERSIONS = (2, 3)
MAX_ARRAY_DEPTH = 4  # arrays of arrays: runlm reads none, llama.cpp none; a bound keeps recursion shallow
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = (1 << 63) - 1  # ggml counts elements in int64
_MIN_WIDTH = {**{t: np.dtype(f).itemsize for t, f in _NUMPY.items()}, 8: 8, 9: 12}  # bytes an item takes at least


class _Corrupt(ValueError):
    """A malformed header; the message names the key or tensor and what was expected."""


# GGML type id -> name, for the types runlm reads (the others are looked up in the gguf package, when a file has one)
_READ_TYPES = {type_id: name for name, type_id in RUN_TYPES.items()}


def _tensor_type(type_id: int) -> tuple[str, int, int]:
    """A GGML type id's name, values per block and bytes per block."""
    name = _READ_TYPES.get(type_id)
    if name is not None:
        return name, *BLOCK_LAYOUTS[name]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # here: importing it takes a tenth of a second

    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        raise _Corrupt(f"unknown tensor type id {type_id}") from None
    return qtype.name, *GGML_QUANT_SIZES[qtype]


def _string_starts(buf: np.ndarray, at: int, count: int) -> tuple[np.ndarray, int]:
    """Where each of `count` strings from byte `at` starts, and where the last ends (past the buffer's end where one
    runs past it): walked by the kernels' library where the install built it (Gemma 3's 262k: 2 ms, not 60)."""
    starts = np.empty(count, dtype=np.int64)
    try:
        from runlm.native import library

        lib = library.library(build_missing=False)
    except (RunlmError, OSError):
        lib = None
    if lib is not None and count:
        end = lib.rl_gguf_string_starts(library.address(buf), len(buf), at, count,
                                        starts.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
        return starts, end if end >= 0 else len(buf) + 1
    mem, unpack_u64 = memoryview(buf), _U64.unpack_from
    try:
        for i in range(count):
            starts[i] = at
            at += 8 + unpack_u64(mem, at)[0]
    except (struct.error, OverflowError):  # a length that runs past the end of the map, or past 2^63
        at = len(buf) + 1
    return starts, at


def _read_strings(buf: np.ndarray, at: int, count: int) -> tuple[list[str], int]:
    """A string array of `count` items at byte `at` (a vocabulary: 262k strings) and where it ends. Python walks only
    the length prefixes; numpy turns each prefix's last byte into a NUL and drops the other seven, so one decode and
    one split make every string (a string that holds a NUL itself sends the array through slices one by one)."""
    mem, start = memoryview(buf), at
    starts, at = _string_starts(buf, at, count)
    if at > len(buf):
        raise _Corrupt(f"an array of {count} strings at byte {start} runs past the end of the file")
    if count == 0:
        return [], at
    region = buf[start:at].copy()
    prefixes = starts - start
    keep = np.ones(len(region), dtype=bool)
    keep[(prefixes[:, None] + np.arange(7)).ravel()] = False
    region[prefixes + 7] = 0
    items = region[keep].tobytes().decode("utf-8", "replace").split("\0")[1:]
    if len(items) == count:
        return items, at
    ends = [*starts[1:].tolist(), at]
    return [str(mem[s + 8 : e], "utf-8", "replace") for s, e in zip(starts.tolist(), ends, strict=True)], at


def _parse(buf: np.ndarray) -> tuple[dict[str, Any], dict[str, _TensorInfo]]:
    """The header of a GGUF file: metadata and tensor infos, every count and offset checked against the file.

    Counts are bounded by the bytes left (an item takes at least its minimum width), so a forged count fails at
    once instead of looping or allocating; arrays nest at most MAX_ARRAY_DEPTH deep.
    """
    mem = memoryview(buf)
    size, unpack_u64 = len(mem), _U64.unpack_from
    if size < 24:
        raise _Corrupt(f"the file is {size} bytes, shorter than a GGUF header (24)")
    pos = 4
    (version,) = struct.unpack_from("<I", mem, pos)
    pos += 4
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise _Corrupt(f"GGUF version {version} is not supported{hint}: runlm reads versions 2 and 3")
    n_tensors, n_kv = struct.unpack_from("<QQ", mem, pos)
    pos += 16
    # a metadata entry takes at least 13 bytes (key length, value type, one byte), a tensor info 28
    if n_kv > (size - pos) // 13:
        raise _Corrupt(f"the header declares {n_kv} metadata entries, more than the file can hold")
    if n_tensors > (size - pos) // 28:
        raise _Corrupt(f"the header declares {n_tensors} tensors, more than the file can hold")

    def read_str(at: int) -> tuple[str, int]:
        # kept lean: a vocabulary array calls this hundreds of thousands of times
        (length,) = unpack_u64(mem, at)
        end = at + 8 + length
        if end > size:
            raise _Corrupt(f"a string of {length} bytes at byte {at} runs past the end of the file")
        return str(mem[at + 8 : end], "utf-8", "replace"), end

    def read_value(vtype: int, at: int, depth: int = 0) -> tuple[Any, int]:
        if vtype == 8:
            return read_str(at)
        if vtype == 9:
            if depth >= MAX_ARRAY_DEPTH:
                raise _Corrupt(f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
            item_type, count = struct.unpack_from("<IQ", mem, at)
            at += 12
            if item_type not in _MIN_WIDTH:
                raise _Corrupt(f"array of unknown value type {item_type}")
            if count > (size - at) // _MIN_WIDTH[item_type]:
                raise _Corrupt(f"an array of {count} items runs past the end of the file")
            if item_type == 8:
                return _read_strings(buf, at, count)
            if item_type in _NUMPY:
                array = np.frombuffer(mem, dtype=_NUMPY[item_type], count=count, offset=at)
                return array.tolist(), at + _MIN_WIDTH[item_type] * count
            items = []
            for _ in range(count):
                item, at = read_value(item_type, at, depth + 1)
                items.append(item)
            return items, at
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise _Corrupt(f"unknown value type {vtype} (GGUF types are 0-12)")
        (value,) = struct.unpack_from(fmt, mem, at)
        return value, at + struct.calcsize(fmt)

    metadata: dict[str, Any] = {}
    for index in range(n_kv):
        key, pos = read_str(pos)
        if key in metadata:
            raise _Corrupt(f"metadata key {key!r} appears twice")
        try:
            (vtype,) = struct.unpack_from("<I", mem, pos)
            metadata[key], pos = read_value(vtype, pos + 4)
        except (struct.error, ValueError) as exc:
            raise _Corrupt(f"metadata key {key!r} (entry {index}): {exc}") from exc

    alignment = metadata.get("general.alignment", 32)
    if type(alignment) is not int or alignment <= 0 or alignment % 8 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment is {alignment!r}, expected a power of two that is a multiple of 8")

    infos, seen = [], set()
    for index in range(n_tensors):
        name, pos = read_str(pos)
        try:
            if name in seen:
                raise _Corrupt("the name appears twice")
            seen.add(name)
            (n_dims,) = struct.unpack_from("<I", mem, pos)
            if not 1 <= n_dims <= MAX_DIMS:
                raise _Corrupt(f"{n_dims} dimensions, expected 1 to {MAX_DIMS}")
            dims = struct.unpack_from(f"<{n_dims}Q", mem, pos + 4)
            pos += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", mem, pos)
            pos += 12
            type_name, block, type_size = _tensor_type(ggml_type)
            count = math.prod(dims)
            if count > MAX_ELEMENTS:
                raise _Corrupt(f"dimensions {list(dims)} overflow a 64-bit element count")
            if dims[0] % block:
                raise _Corrupt(f"a row of {dims[0]} elements does not fill {type_name} blocks of {block}")
            if offset % alignment:
                raise _Corrupt(f"data offset {offset} is not a multiple of the alignment {alignment}")
        except (struct.error, _Corrupt) as exc:
            raise _Corrupt(f"tensor {name!r} (entry {index}): {exc}") from exc
        infos.append((name, type_name, tuple(int(d) for d in reversed(dims)), offset, count // block * type_size))

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
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.sinks": "attn_sinks",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router
    "mlp.experts.gate_proj": "ffn_gate_exps",  # every expert's weights in one tensor [experts, rows, cols]
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.experts.gate_up_proj": "ffn_gate_up_exps",  # gate and up stacked, every expert's (Gemma 4)
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # a shared expert and its one-row gate
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "layer_scalar": "layer_output_scale",  # Gemma 4's scale of a block's output
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

    def __init__(
        self,
        gguf,
        rename: Callable[[str], str],
        row_perm: Callable[[str], torch.Tensor | None],
        expect: ShapeRule | None = None,
    ):
        self.gguf, self.rename, self.row_perm, self.path, self.expect = gguf, rename, row_perm, gguf.path, expect

    def has(self, name: str) -> bool:
        return self.gguf.has(self.rename(name))

    def raw(self, name: str):
        stored_as = self.rename(name)
        self.check_shape(name, self.gguf.shape(stored_as), stored_as)  # from the header, before any byte is read
        raw = self.gguf.raw(stored_as)
        if raw.type_name not in BLOCK_LAYOUTS:
            raise ModelLoadError(
                f"{self.path}: tensor {raw.name!r} is stored as {raw.type_name}, a type runlm cannot read "
                f"(it reads: {', '.join(BLOCK_LAYOUTS)})"
            )
        perm = self.row_perm(name)
        if perm is None or len(raw.shape) == 1:  # a vector (a Q or K bias) is put in order by `tensor`
            return raw
        return RawTensor(raw.name, raw.type_name, raw.shape, raw.read_rows(0, raw.shape[0])[perm.numpy()])

    def tensor(self, name: str) -> torch.Tensor:
        values = _dequantized(self.raw(name), self.path)
        perm = self.row_perm(name) if values.dim() == 1 else None
        return values if perm is None else values[perm]


def find_mmproj(model_path: Path) -> list[Path]:
    """Vision projector GGUFs next to a text GGUF (llama.cpp's naming: mmproj*.gguf)."""
    found = model_path.parent.glob("*.gguf")
    return sorted(p for p in found if p.name.lower().startswith("mmproj") and p != model_path)


def weights_bytes_per_token(gguf: GGUFFile) -> int:
    """Bytes of weights one decode step reads: every tensor of the file, but only one row of an untied embedding
    table (a tied one is read whole as the output head), and of each tensor of all the experts ([experts, rows,
    cols]) the share of the experts a token uses. The KV cache is not counted."""
    experts, used = gguf.arch_value("expert_count"), gguf.arch_value("expert_used_count")
    total = 0
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        nbytes = raw.data.nbytes
        if name == "token_embd.weight" and gguf.has("output.weight"):
            nbytes //= raw.shape[0]
        elif "_exps." in name and isinstance(experts, int) and isinstance(used, int) and 0 < used <= experts:
            nbytes = nbytes * used // experts
        total += nbytes
    return total


def quantization_of(gguf: GGUFFile) -> str:
    """The file's quantization as users name it: the tensor type holding most of its bytes ("Q4_K", "Q8_0"...)."""
    counts: dict[str, int] = {}
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        counts[raw.type_name] = counts.get(raw.type_name, 0) + raw.data.nbytes
    return max(counts, key=counts.get) if counts else "unknown"
