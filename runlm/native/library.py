"""runlm's C++ kernels without PyTorch: kernels.cpp compiled with -DRUNLM_STANDALONE into a plain shared library per
instruction-set variant when runlm is installed (setup.py), the one this CPU runs chosen here at run time
(runlm.native.build.variant), called through ctypes on numpy arrays. Where the install built none (a platform without
a compiler then, or a source changed since: each library carries its source's key), it is compiled at first use into
$RUNLM_HOME/lean, ~30 s. The flags, the variant (RUNLM_GGUF_KERNELS) and the decode walk are the PyTorch extension's
(runlm.native.build), so both builds compute the same bits. A transformer block goes to C as one `Block` struct
(kernels.cpp's RlBlock)."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from runlm.catalog import runlm_home
from runlm.errors import ModelLoadError, RunlmError
from runlm.native import build

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
_PP = ctypes.POINTER(ctypes.c_void_p)  # takes a `pointers` array
_PI = ctypes.POINTER(ctypes.c_int64)  # takes an `int64s` array
_SIGNATURES = {
    "rl_last_error": ([], ctypes.c_char_p),
    "rl_isa": ([], ctypes.c_char_p),
    "rl_source_key": ([], ctypes.c_char_p),
    "rl_group_rows": ([_i64], _i64),
    "rl_simd": ([], _i64),
    "rl_set_threads": ([ctypes.c_int], ctypes.c_int),
    "rl_set_decode_walk": ([_i64, _i64, _i64, _i64, _i64], ctypes.c_int),
    "rl_linear": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr], ctypes.c_int),
    "rl_dequantize_rows": ([_ptr, _i64, _i64, _i64, _PI, _i64, _ptr], ctypes.c_int),
    "rl_rms_norm": ([_ptr, _i64, _i64, _ptr, _f64, _ptr], ctypes.c_int),
    "rl_relayout": ([_ptr, _i64, _i64, _i64, _ptr], ctypes.c_int),
    "rl_stack_new": ([], _ptr),
    "rl_stack_free": ([_ptr], None),
    "rl_stack_add_block": ([_ptr, ctypes.c_void_p], ctypes.c_int),
    "rl_gguf_string_starts": ([_ptr, _i64, _i64, _i64, _PI], _i64),
    "rl_spm_new": ([ctypes.c_char_p, _i64, _i64, _ptr, _i64], _ptr),
    "rl_spm_add_token": ([_ptr, ctypes.c_char_p, _i64, _i64, _i64], ctypes.c_int),
    "rl_spm_set_unknown": ([_ptr, _i64], ctypes.c_int),
    "rl_spm_free": ([_ptr], None),
    "rl_spm_size": ([_ptr], _i64),
    "rl_spm_piece_id": ([_ptr, ctypes.c_char_p, _i64], _i64),
    "rl_spm_own_ids": ([_ptr, _PI, _i64, _ptr], ctypes.c_int),
    "rl_spm_encode": ([_ptr, ctypes.c_char_p, _i64, _i64, _ptr, _i64, _PI], ctypes.c_int),
    "rl_bpe_new": ([ctypes.c_char_p, _i64, _i64, _ptr, ctypes.c_char_p, _i64, _i64, ctypes.c_char_p, _i64, _i64,
                    _i64], _ptr),
    "rl_bpe_add_token": ([_ptr, ctypes.c_char_p, _i64, _i64, _i64], ctypes.c_int),
    "rl_bpe_free": ([_ptr], None),
    "rl_bpe_size": ([_ptr], _i64),
    "rl_bpe_piece_id": ([_ptr, ctypes.c_char_p, _i64], _i64),
    "rl_bpe_own_ids": ([_ptr, _PI, _i64, _ptr], ctypes.c_int),
    "rl_bpe_encode": ([_ptr, ctypes.c_char_p, _i64, _i64, _ptr, _i64, _PI], ctypes.c_int),
    "rl_stack_run": (
        [_ptr, _ptr, _i64, _PP, _PP, _i64, _PI, _ptr, _ptr, _ptr, _PI, _i64, _i64, _PI, _PI, _ptr],
        ctypes.c_int,
    ),
}


class Weight(ctypes.Structure):
    """One weight as the kernels read it (kernels.cpp's RlWeight): its bytes, type id and rows."""

    _fields_ = [("data", _ptr), ("type", _i64), ("rows", _i64)]


class Block(ctypes.Structure):
    """One transformer block, whole (kernels.cpp's RlBlock, field for field): the one way a block reaches C."""

    _fields_ = [
        ("norms", _ptr * 4), ("n_norms", _i64), ("hidden", _i64), ("eps", _f64), ("q_norm", _ptr), ("k_norm", _ptr),
        ("qkv", Weight * 3), ("n_qkv", _i64), ("o", Weight), ("gate_up", Weight * 2), ("n_gate_up", _i64),
        ("down", Weight), ("activation", _i64), ("rope", _i64), ("window", _i64), ("n_heads", _i64),
        ("n_kv_heads", _i64), ("scale", _f64), ("qkv_bias", _ptr), ("qk_norm_whole", _i64), ("residual_scale", _f64),
        ("attn_softcap", _f64), ("n_experts", _i64), ("n_experts_used", _i64), ("router", Weight),
        ("expert_gate_up", ctypes.POINTER(Weight)), ("n_expert_gate_up", _i64), ("expert_down", ctypes.POINTER(Weight)),
        ("expert_gating", _i64), ("expert_normalize", _i64), ("o_bias", _ptr), ("sinks", _ptr), ("gate_up_bias", _ptr),
        ("down_bias", _ptr), ("router_bias", _ptr), ("expert_gate_up_bias", _ptr), ("expert_down_bias", _ptr),
        ("shared_gate_up", Weight * 2), ("n_shared_gate_up", _i64), ("shared_down", Weight), ("shared_gate", Weight),
        ("attn_temp_scale", _f64), ("attn_temp_length", _i64), ("values_from_keys", _i64), ("value_norm", _i64),
        ("out_scale", _f64), ("kv_source", _i64), ("ple_gate", Weight), ("ple_proj", Weight), ("ple_norm", _ptr),
        ("ple_dim", _i64), ("moe_norms", _ptr * 3), ("router_scale", _ptr), ("expert_scales", _ptr),
    ]  # fmt: skip


_lock = threading.Lock()
_library: ctypes.CDLL | None = None


class KernelError(RunlmError):
    """The standalone kernels refused a call (their message says why)."""


def _library_path() -> Path:
    """Where this CPU's build of this source with these flags lives when the install built none."""
    return runlm_home() / "lean" / f"runlm_kernels_{build.variant()}_{build.build_key()}.so"


def installed_library() -> ctypes.CDLL | None:
    """The variant's library the install built, where there is one of this source and these flags."""
    spec = importlib.util.find_spec(f"runlm.native._kernels_{build.variant()}")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        lib.rl_source_key.restype = ctypes.c_char_p
        key = lib.rl_source_key().decode()
    except (OSError, AttributeError):
        return None
    return lib if key == build.source_key(build.variant()) else None


def _compile(target: Path) -> None:
    compiler = os.environ.get("CXX", "g++").split()[0]
    if shutil.which(compiler) is None:
        raise ModelLoadError(f"runlm's kernels: no C++ compiler ({compiler} not found): install g++ or set CXX")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *build.STANDALONE_FLAGS, *build.variant_cflags(),
                   f'-DRUNLM_SOURCE_KEY="{build.source_key(build.variant())}"', "-shared", "-fPIC",
                   str(build.SOURCE), "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            first = next((line for line in result.stderr.splitlines() if "error" in line), result.stderr[:300])
            raise ModelLoadError(f"runlm's kernels: building them failed: {first.strip()}")
        os.replace(built, target)  # atomic: a concurrent build never loads a half-written file


def _whole_elf(path: Path) -> bool:
    """Whether `path` is a 64-bit ELF file that holds every segment its header names: dlopen maps those segments
    and a process that touches one past a truncated file's end dies of SIGBUS, so a short file is rebuilt first."""
    if sys.platform != "linux":  # another format (Mach-O): its loader's own checks stand
        return path.is_file()
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if len(data) < 64 or data[:5] != b"\x7fELF\x02":
        return False
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
        return False
    for i in range(phnum):
        _, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if offset + filesz > len(data):
            return False
    return True


def _built_library() -> ctypes.CDLL:
    """The library built under runlm's home (built now where it is missing). A file there that does not load (a
    build cut short, a disk error) is built again, once; a second failure is one line, never a crash."""
    path = _library_path()
    for attempt in range(2):
        if attempt or not _whole_elf(path):
            _compile(path)
        try:
            lib = ctypes.CDLL(str(path))
            lib.rl_source_key.restype = ctypes.c_char_p
            if lib.rl_source_key().decode() == build.source_key(build.variant()):
                return lib
        except (OSError, AttributeError):
            pass
    raise ModelLoadError(f"runlm's kernels: {path} does not load after building it again")


def library(build_missing: bool = True) -> ctypes.CDLL:
    """The standalone kernels, built on first use (ModelLoadError where `build_missing` is false and the install built
    none); the decode walk and its signatures set."""
    global _library
    with _lock:
        if _library is None:
            if build.variant() == "off":
                raise ModelLoadError(f"the native runtime needs runlm's C++ kernels, which {build.ENV_VAR}=0 turns off")
            lib = installed_library()
            if lib is None and not build_missing:
                raise ModelLoadError("runlm's kernels: the install built none for this CPU")
            lib = lib or _built_library()
            for name, (args, result) in _SIGNATURES.items():
                function = getattr(lib, name)
                function.argtypes, function.restype = args, result
            _library = lib
            check(lib.rl_set_decode_walk(*build.DECODE_WALKS[build.decode_walk_name(lib.rl_isa().decode())]))
    return _library


def check(status: int) -> None:
    """Raise the library's error for a failed call."""
    if status != 0:
        raise KernelError(library().rl_last_error().decode(errors="replace"))


def isa() -> str:
    return library().rl_isa().decode()


def group_rows(type_id: int) -> int:
    """Rows per group of a type's interleaved layout in this build (4 or 16; 0: none)."""
    return int(library().rl_group_rows(type_id))


def simd() -> bool:
    """Whether this build has the vector kernels (the interleaved layouts are for them)."""
    return bool(library().rl_simd())


def set_threads(threads: int) -> None:
    check(library().rl_set_threads(threads))


def address(array: np.ndarray) -> int:
    """A C-contiguous array's data pointer."""
    if not array.flags.c_contiguous:
        raise ValueError("the kernels take C-contiguous arrays")
    return array.ctypes.data


def pointers(values: list[int | None]) -> ctypes.Array:
    """An array of void* for a call (the C side copies what it keeps)."""
    return (ctypes.c_void_p * max(len(values), 1))(*values)


def int64s(values: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * max(len(values), 1))(*values)


def linear(x: np.ndarray, blocks: np.ndarray, type_id: int, out_features: int) -> np.ndarray:
    """x [M, K] float32 @ W.T for GGUF blocks W (type id, + X4 for the interleaved layout): [M, out_features]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.empty((x.shape[0], out_features), dtype=np.float32)
    check(library().rl_linear(address(x), x.shape[0], x.shape[1], address(blocks), type_id, out_features, address(y)))
    return y


def dequantize_rows(blocks: np.ndarray, type_id: int, rows: int, width: int, ids: np.ndarray) -> np.ndarray:
    """The rows `ids` of GGUF blocks W [rows, width] as float32 [len(ids), width]."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    out = np.empty((ids.size, width), dtype=np.float32)
    check(library().rl_dequantize_rows(address(blocks), type_id, rows, width,
                                       ids.ctypes.data_as(_PI), ids.size, address(out)))
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty_like(x)
    check(library().rl_rms_norm(address(x), x.size // weight.size, weight.size, address(weight), eps, address(out)))
    return out


def relayout(source: np.ndarray, type_id: int, rows: int, cols: int, out: np.ndarray) -> None:
    """GGUF blocks of `rows` rows (type id `type_id`, GGUF's row layout) regrouped into the interleaved layout, in
    `out` (as many bytes)."""
    if source.nbytes != out.nbytes or not out.flags.writeable:
        raise ValueError("relayout needs a writable output of the source's size")
    check(library().rl_relayout(address(source), type_id, rows, cols, address(out)))


__all__ = ["Block", "KernelError", "Weight", "check", "dequantize_rows", "group_rows", "isa", "library", "linear",
           "relayout", "rms_norm", "set_threads", "simd"]
