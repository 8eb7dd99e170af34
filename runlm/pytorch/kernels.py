"""Linear layers that run directly on GGUF quantized blocks through runlm's own C++ kernels (kernels.cpp).

The kernels work like llama.cpp's CPU backend: each activation row is quantized once per call to 8-bit blocks
(per 32 values for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, per 256 values with sums of 16 for the K-quants), and every weight
block meets it in an integer dot product (AVX-512 VNNI `vpdpbusd`/`vpdpwssd` where the CPU has them, AVX2
`maddubs`/`madd` otherwise, FMA accumulation; a scalar path when the compiler does not target AVX2/FMA/F16C). So
the result differs from `x @ dequantize(W).T` by the 8-bit rounding of the activation: ~0.3-0.5% of the output
norm (see tests/quant/test_kernels.py), the same error llama.cpp has. The extension is built for the CPU it runs
on (-march=native, cached per CPU model), so the instruction set is chosen by the machine: `isa()` says which.

The extension is compiled on first use (~30 s, then cached) with `torch.utils.cpp_extension.load` (-O3
-march=native -fopenmp; threads: torch's intra-op pool via at::parallel_for) into torch's extensions cache and
registers the custom ops

    torch.ops.runlm.gguf_linear(Tensor x, Tensor w, int type, int out_features, int in_features) -> Tensor

x float32 [..., in_features] (made contiguous if it is not), w the raw GGUF bytes uint8 [out_features, row_bytes],
`type` the GGML type id (`KERNEL_TYPES`), result float32 [..., out_features]; and

    torch.ops.runlm.gguf_dequantize(Tensor w, int type, int out_features, int in_features) -> Tensor

(float32 [out_features, in_features], same values as `runlm.pytorch.dequant.dequantize`). Both have fake (meta)
kernels, so `torch.compile` treats them as opaque ops. A failed build never raises at import: `available()` is
False, `unavailable_reason()` says why, one warning line on stderr (logger `runlm.kernels`, once per process) names what
was missing (a C++ compiler, ninja) or the build's first error, and callers fall back to `runlm.pytorch.int4`.

With many activation rows (prefill) GGUFLinear switches to dequantize + float32 GEMM, see DENSE_MIN_ROWS (weights in
16-row groups never do).

Environment: RUNLM_GGUF_KERNELS=0 disables the kernels; RUNLM_GGUF_KERNELS=scalar builds the portable scalar
path, RUNLM_GGUF_KERNELS=avx2 the AVX2 path without AVX-512 (what an AVX2-only CPU runs), instead of the best this
CPU runs (for testing them; one variant per process, since all register `runlm::`). RUNLM_DECODE_WALK=line|burst picks
how the interleaved kernels prefetch a decode GEMV's weights instead of the build's and CPU's default
(`DECODE_WALKS`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import cpp_extension

from runlm.errors import InvalidInputError, ModelLoadError
from runlm.native import build
from runlm.pytorch.dequant import BLOCK_LAYOUTS, dequantize, normalize_type_name

KERNEL_TYPES, X4_TYPES, X4 = build.KERNEL_TYPES, build.X4_TYPES, build.X4

# From this many activation rows on, forward dequantizes W in C++ (runlm::gguf_dequantize) and runs a float32
# GEMM instead of the 8-bit kernels. Without AVX-VNNI the int8 multiplies (vpmaddubsw + vpmaddwd) cap the kernels
# at about float32 GEMM speed, so once the dequantization is amortized over enough rows the GEMM wins; measured
# crossovers (1 thread, 2-core AVX2 EPYC): 32-wide types ~40-48 rows, Q4_K ~48-64, Q6_K ~128-192.
DENSE_MIN_ROWS: dict[str, int] = {
    "Q4_0": 48,
    "Q4_1": 48,
    "Q5_0": 48,
    "Q5_1": 48,
    "Q8_0": 48,
    "Q4_K": 64,
    "Q5_K": 64,
    "Q2_K": 128,
    "Q3_K": 128,
    "Q6_K": 192,
    "MXFP4": 48,  # not measured: as the other 32-wide types
    "IQ4_NL": 48,  # not measured either
    "IQ4_XS": 128,  # not measured: as the other K-quant-sized types
}
# dense_min_rows of a weight that always runs on the kernels (16-row groups: `GGUFLinear`)
NEVER_DENSE = 1 << 62
# float32 weight elements dequantized at a time on the dense path (64 MiB), so a 262144-row head stays bounded.
_DENSE_CHUNK_ELEMENTS = 1 << 24
# Bytes of a weight read and regrouped at a time at load, through one scratch buffer per loading thread that is
# kept, not freed: a temporary above glibc malloc's mmap threshold (128 KiB) raises that threshold when freed,
# after which the weights allocated between such temporaries fragment the heap (+180 MB resident on the 1B shape
# with 16 MiB temporaries). Chunks regroup straight into the module's buffer (gguf_relayout_into).
_LOAD_CHUNK_BYTES = 4 << 20
_load_scratch = threading.local()


def _scratch_rows(rows: int, row_bytes: int) -> np.ndarray:
    """`rows` x `row_bytes` of this thread's load scratch (_LOAD_CHUNK_BYTES, or more for 4 huge rows; kept)."""
    buffer = getattr(_load_scratch, "buffer", None)
    if buffer is None or buffer.size < rows * row_bytes:
        buffer = _load_scratch.buffer = np.empty(max(_LOAD_CHUNK_BYTES, rows * row_bytes), dtype=np.uint8)
    return buffer[: rows * row_bytes].reshape(rows, row_bytes)


class WeightRows(Protocol):
    """Raw GGUF bytes of a row-major (rows, cols) weight, as `runlm.formats.gguf.RawTensor` hands them out."""

    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray | torch.Tensor  # all the bytes; a view of the file's map where `mapped`
    mapped: bool

    def read_rows(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """Copy rows [start, stop) into `out` (for a file: read, not through the map)."""
        ...


# the build's settings, shared with runlm.native's build (runlm.native.build), named here for callers of this module
ENV_VAR, WALK_ENV_VAR, DECODE_WALKS = build.ENV_VAR, build.WALK_ENV_VAR, build.DECODE_WALKS

log = logging.getLogger("runlm.kernels")
_lock = threading.Lock()
_state: dict[str, object] = {"ok": None, "reason": None, "build_s": None, "simd": None, "isa": None, "name": None,
                             "walk": None}


def _op_registered() -> bool:
    try:
        torch.ops.runlm.gguf_linear  # noqa: B018 - attribute lookup raises when the op is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def _extension_name() -> str:
    """The torch extension of this variant, source, flags and torch."""
    return f"runlm_gguf_{build.variant()}_{build.build_key(torch.__version__)}"


def _build_directory(name: str) -> Path:
    """Where torch builds the extension `name` (TORCH_EXTENSIONS_DIR, or torch's cache)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextmanager
def _sole_builder(directory: Path) -> Iterator[None]:
    """Hold the one build of `directory`. torch's own build lock is a file a build deletes when it ends, so a build
    that was killed leaves it behind and every later one waits on it forever; an flock ends with its process, so
    under one a torch lock still there can only be such a leftover, and goes."""
    with open(directory / "runlm-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def _load() -> None:
    variant = build.variant()
    if variant == "off":
        raise RuntimeError(f"disabled by {ENV_VAR}={os.environ.get(ENV_VAR)}")
    start = time.perf_counter()
    if not _op_registered():
        if not build.SOURCE.is_file():
            raise FileNotFoundError(f"kernel source {build.SOURCE} is missing")
        cflags = build.variant_cflags()
        name = _extension_name()
        _put_pip_ninja_on_path()
        torch_log = logging.getLogger("torch.utils.cpp_extension")
        level = torch_log.level
        torch_log.setLevel(logging.ERROR)  # its compiler-compatibility banner: our one line says what went wrong
        directory = _build_directory(name)
        try:
            with _sole_builder(directory):
                cpp_extension.load(
                    name=name,
                    sources=[str(build.SOURCE)],
                    extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(directory),
                    is_python_module=False,
                    verbose=False,
                )
        finally:
            torch_log.setLevel(level)
        _state["name"] = name
    fakes = (
        ("runlm::gguf_linear", _fake_gguf_linear),
        ("runlm::gguf_dequantize", _fake_gguf_dequantize),
        ("runlm::gguf_dequantize_rows", _fake_gguf_dequantize_rows),
        ("runlm::rms_norm", _fake_rms_norm),
        ("runlm::decode_attention", _fake_decode_attention),
    )
    for op_name, fake in fakes:
        try:
            torch.library.register_fake(op_name)(fake)
        except RuntimeError as exc:  # registered already (e.g. this module was reloaded)
            if "already" not in str(exc):
                raise
    _state["isa"] = str(torch.ops.runlm.gguf_isa())
    _state["walk"] = build.decode_walk_name(_state["isa"])
    torch.ops.runlm.gguf_set_decode_walk(*DECODE_WALKS[_state["walk"]])
    _state["simd"] = bool(torch.ops.runlm.gguf_simd())
    _state["build_s"] = time.perf_counter() - start


def _put_pip_ninja_on_path() -> None:
    """torch looks for ninja on PATH only; pip's ninja sits beside this Python, which PATH lacks when the venv is not
    activated (or runlm was installed with pipx)."""
    scripts = sysconfig.get_path("scripts")
    if scripts and shutil.which("ninja") is None and shutil.which("ninja", path=scripts):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _fallback_warning(exc: Exception) -> str:
    """The one line a user gets when the kernels cannot be built: what was missing, and that runlm goes on."""
    compiler = (cpp_extension.get_cxx_compiler().split() or [""])[0]  # CXX may be "ccache g++"
    if not compiler or shutil.which(compiler) is None:
        cause = f"no C++ compiler: {compiler or 'CXX'} not found, install g++ or set CXX"
    elif not cpp_extension.is_ninja_available():
        cause = "ninja not found on PATH, pip install ninja"
    else:  # the compiler's first diagnostic, else the exception's first line
        lines = str(exc).splitlines() or [type(exc).__name__]
        first_error = next((line for line in lines if re.search(r"\berror:", line)), lines[0])
        cause = "build error: " + " ".join(first_error.split())[:200]
    return (f"runlm: C++ kernels unavailable ({cause}); running on plain PyTorch instead, which is slower "
            f"({ENV_VAR}=0 skips the build)")


def _fake_gguf_linear(x: torch.Tensor, w: torch.Tensor, type: int, out_features: int, in_features: int):
    return x.new_empty((*x.shape[:-1], out_features))


def _fake_gguf_dequantize(w: torch.Tensor, type: int, out_features: int, in_features: int):
    return w.new_empty((out_features, in_features), dtype=torch.float32)


def _fake_gguf_dequantize_rows(w: torch.Tensor, type: int, out_features: int, in_features: int, ids: torch.Tensor):
    return w.new_empty((ids.numel(), in_features), dtype=torch.float32)


def _fake_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_decode_attention(qkv, cos, sin, k_cache, v_cache, pos: int, n_heads: int, n_kv_heads: int, scale: float):
    return qkv.new_empty((n_heads * cos.shape[-1],))  # a q8_0 cache row is not head_dim wide


def available() -> bool:
    """Whether the kernels are usable; builds (or loads the cached build of) the extension on the first call."""
    if _state["ok"] is None:
        with _lock:
            if _state["ok"] is None:
                try:
                    _load()
                    _state["ok"] = True
                except Exception as exc:  # compiler missing, build error, ...: callers fall back
                    message = " ".join(str(exc).split())
                    if len(message) > 2000:
                        message = message[:2000] + " ..."
                    _state["reason"] = f"runlm GGUF kernels unavailable: {type(exc).__name__}: {message}"
                    _state["ok"] = False
                    if build.variant() != "off":  # asked for: nothing to warn about
                        log.warning(_fallback_warning(exc))
    return bool(_state["ok"])


def simd() -> bool:
    """Whether the kernels were built with their AVX2 path (False: the portable scalar one, or none)."""
    return available() and bool(_state["simd"])


def isa() -> str | None:
    """The instruction set the kernels were built for: "avx512-vnni+amx" (prefill on AMX tiles), "avx512-vnni",
    "avx-vnni", "avx2" or "scalar" (None: no kernels)."""
    return _state["isa"] if available() else None  # type: ignore[return-value]


def decode_walk() -> str | None:
    """How the interleaved kernels walk a decode GEMV's weights in this process (a name in `DECODE_WALKS`;
    None where the build has no interleaved groups: no kernels, or the scalar path)."""
    return _state["walk"] if build.walks_weights(isa() or "") else None  # type: ignore[return-value]


def decode_walk_summary() -> str:
    """The decode walk in words (build.decode_walk_summary for this build)."""
    return build.decode_walk_summary(isa() or "")


def build_flags() -> str:
    """The compiler flags of this process's kernel build (RUNLM_GGUF_KERNELS picks the variant)."""
    return " ".join(build.variant_cflags())


def amx_absence() -> str:
    """Why K-quant and Q8_0 prefill do not run on AMX tiles here (when `isa()` has no "+amx")."""
    return build.amx_absence()


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when available or not yet tried)."""
    return _state["reason"]  # type: ignore[return-value]


def build_info() -> dict[str, object]:
    """ok, reason, build_s (seconds the first load took: compile or cache hit), simd (AVX2 path), isa, name, walk."""
    return dict(_state)


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, type_name: str, out_features: int) -> torch.Tensor:
    """float32 x [M, K] @ W.T for W given as GGUF blocks uint8 [out_features, row_bytes]; needs `available()`."""
    name = normalize_type_name(type_name)
    return torch.ops.runlm.gguf_linear(x, blocks, KERNEL_TYPES[name], int(out_features), int(x.shape[-1]))


def gguf_dequantize(blocks: torch.Tensor, type_name: str, shape: Sequence[int]) -> torch.Tensor:
    """float32 [rows, cols] from GGUF blocks uint8 [rows, row_bytes] with the C++ decoder; needs `available()`.

    Same values as `dequant.dequantize` (bit for bit in the tests). Rows may be any subset of a weight's rows,
    e.g. `blocks[token_ids]` for an embedding lookup that keeps the table quantized.
    """
    name = normalize_type_name(type_name)
    return torch.ops.runlm.gguf_dequantize(blocks, KERNEL_TYPES[name], int(shape[0]), int(shape[1]))


def _row_bytes(type_name: str, in_features: int) -> int:
    block_size, type_size = BLOCK_LAYOUTS[type_name]
    return in_features // block_size * type_size


def _byte_view(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The bytes of `data` as a flat uint8 tensor, sharing its memory where it can (only to be read)."""
    if isinstance(data, torch.Tensor):
        t = data.detach().cpu().contiguous().reshape(-1)
        return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    arr = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():  # a read-only memory map: torch warns that the view is not writable
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class _OwnedRows:
    """WeightRows over bytes the caller holds."""

    mapped = False

    def __init__(self, type_name: str, data: np.ndarray | torch.Tensor, shape: Sequence[int]):
        self.type_name, self.data, self.shape = type_name, data, tuple(int(d) for d in shape)

    def read_rows(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        rows = _byte_view(self.data).view(self.shape[0], -1)
        np.copyto(out.reshape(stop - start, -1), rows[start:stop].numpy())
        return out


def group_rows(type_name: str) -> int:
    """Rows per group of `type_name`'s interleaved layout in the built kernels (4 or 16; 0: none)."""
    if type_name not in X4_TYPES:
        return 0
    return int(torch.ops.runlm.gguf_group_rows(KERNEL_TYPES[type_name]))


def _has_x4(type_name: str, out_features: int) -> bool:
    """Whether a weight can take the interleaved layout: the AVX2 kernels, a type with groups in this build (IQ4_XS
    has them in AVX-512 builds only), whole groups.

    (The layout has a portable kernel too, which rebuilds the row layout block by block: scalar builds keep the
    file's layout and its own kernel.)"""
    group = group_rows(type_name) if simd() else 0
    return group > 0 and out_features % group == 0


class GGUFLinear(nn.Module):
    """x @ W.T with W kept as raw GGUF blocks (buffer `blocks`, uint8 [out_features, row_bytes]).

    forward accepts any float dtype and leading dims; the kernel computes in float32 and the result is cast back
    to x's dtype. Without the compiled kernels it still works by dequantizing W on every call (slow).
    """

    def __init__(self, type_name: str, blocks: torch.Tensor, in_features: int, out_features: int, x4: bool = False):
        super().__init__()
        name = normalize_type_name(type_name)
        if name not in KERNEL_TYPES:
            raise InvalidInputError(f"no GGUF kernel for type {name} (supported: {', '.join(KERNEL_TYPES)})")
        block_size, _ = BLOCK_LAYOUTS[name]
        in_features, out_features = int(in_features), int(out_features)
        if in_features <= 0 or in_features % block_size or out_features < 0:
            raise InvalidInputError(f"{name} linear needs in_features a positive multiple of {block_size}")
        row_bytes = _row_bytes(name, in_features)
        if blocks.dtype != torch.uint8 or blocks.numel() != out_features * row_bytes:
            raise InvalidInputError(
                f"{name} [{out_features}, {in_features}] needs uint8 blocks of {out_features * row_bytes} bytes, "
                f"got {blocks.dtype} with {blocks.numel()}"
            )
        group = group_rows(name) if x4 and available() else 0
        if x4 and (not group or out_features % group):
            raise InvalidInputError(f"no interleaved layout for {name} with {out_features} rows")
        self.register_buffer("blocks", blocks.reshape(out_features, row_bytes).contiguous())
        self.type_name = name
        self.x4 = x4  # blocks in the interleaved layout (see X4_TYPES); else GGUF's own row layout
        self.group = group if x4 else 1  # rows per interleaved group
        self.type_id = KERNEL_TYPES[name] + (X4 if x4 else 0)
        self.in_features = in_features
        self.out_features = out_features
        # activation rows from which forward takes the dequantize + float32 GEMM path (see DENSE_MIN_ROWS); never for
        # 16-row groups, whose 512-bit VNNI kernels stay ahead of it at every row count
        self.dense_min_rows = DENSE_MIN_ROWS[name] if self.group < 16 else NEVER_DENSE
        self._kernel = available()

    @classmethod
    def from_raw(
        cls, type_name: str, data: np.ndarray | torch.Tensor, shape: Sequence[int], interleave: bool = False
    ) -> GGUFLinear:
        """Copy raw GGUF bytes (rows x row_bytes, or flat) of a row-major (out_features, in_features) weight.

        `interleave`: straight into the x4 layout where the weight can take it (one copy, not two).
        """
        if len(shape) != 2:
            raise InvalidInputError(f"linear weight must be 2-D, got shape {tuple(shape)}")
        return cls.from_parts(type_name, [_OwnedRows(type_name, data, shape)], interleave)

    @classmethod
    def from_parts(cls, type_name: str, parts: Sequence[WeightRows], interleave: bool = False) -> GGUFLinear:
        """One weight from parts of one type and width stacked along the output dim (fused QKV / gate-up).

        A lone file-mapped part whose layout is kept is used from the map as it is. Otherwise the parts are read
        (`read_rows`: from a file with pread, not through its map) into one buffer of the module's own, straight
        into place, or `_LOAD_CHUNK_BYTES` at a time through a small scratch where `interleave` asks for the x4
        layout and every part has whole 4-row groups: a load holds no file pages and no second copy of a part.
        """
        name = normalize_type_name(type_name)
        if not parts or any(len(part.shape) != 2 for part in parts):
            raise InvalidInputError("GGUFLinear.from_parts needs one or more 2-D weights")
        cols = int(parts[0].shape[1])
        if any(int(part.shape[1]) != cols for part in parts):
            raise InvalidInputError(f"cannot stack {name} weights of different widths: {[p.shape for p in parts]}")
        row_counts = [int(part.shape[0]) for part in parts]
        if name not in KERNEL_TYPES or cols <= 0 or cols % BLOCK_LAYOUTS[name][0]:  # the constructor says why
            return cls(name, torch.zeros(0, dtype=torch.uint8), cols, sum(row_counts))
        row_bytes = _row_bytes(name, cols)
        for part, rows in zip(parts, row_counts):
            nbytes = _byte_view(part.data).numel()
            if nbytes != rows * row_bytes:
                raise ModelLoadError(f"{name} tensor of shape {(rows, cols)} needs {rows * row_bytes} bytes, "
                                     f"has {nbytes}")
        x4 = interleave and all(_has_x4(name, rows) for rows in row_counts)
        if len(parts) == 1 and parts[0].mapped and not x4:
            return cls(name, _byte_view(parts[0].data), cols, row_counts[0])  # the file's layout, from the map
        blocks = torch.empty(sum(row_counts), row_bytes, dtype=torch.uint8)
        into = blocks.numpy()
        group = group_rows(name) if x4 else 1
        step = max(group, _LOAD_CHUNK_BYTES // row_bytes // group * group)
        first = 0
        for part, rows in zip(parts, row_counts):
            if not x4:
                part.read_rows(0, rows, into[first : first + rows])
            for start in range(0, rows, step) if x4 else ():
                stop = min(rows, start + step)
                chunk = part.read_rows(start, stop, _scratch_rows(stop - start, row_bytes))
                torch.ops.runlm.gguf_relayout_into(torch.from_numpy(chunk), blocks[first + start : first + stop],
                                                   KERNEL_TYPES[name], stop - start, cols)
            first += rows
        return cls(name, blocks, cols, blocks.shape[0], x4=x4)

    def interleaved(self) -> GGUFLinear:
        """This weight in the x4 layout where it has one (see _has_x4), else self."""
        if self.x4 or not _has_x4(self.type_name, self.out_features):
            return self
        blocks = torch.ops.runlm.gguf_relayout(self.blocks, self.type_id, self.out_features, self.in_features)
        return GGUFLinear(self.type_name, blocks, self.in_features, self.out_features, x4=True)

    def plain_blocks(self) -> torch.Tensor:
        """The weight's bytes in GGUF's own row layout, uint8 [out_features, row_bytes]."""
        if not self.x4:
            return self.blocks
        return torch.ops.runlm.gguf_relayout(self.blocks, self.type_id, self.out_features, self.in_features)

    @classmethod
    def cat(cls, modules: Sequence[GGUFLinear]) -> GGUFLinear:
        """Stack several GGUFLinear of one type and in_features along the output dim (fused QKV / gate-up).

        x4 parts stay x4 (their groups never straddle a part); any plain part makes the result plain.
        """
        modules = list(modules)
        if not modules:
            raise InvalidInputError("GGUFLinear.cat needs at least one module")
        kinds = {(m.type_name, m.in_features) for m in modules}
        if len(kinds) != 1:
            raise InvalidInputError(f"cannot concatenate GGUF linears of different type / in_features: {sorted(kinds)}")
        first, x4 = modules[0], all(m.x4 for m in modules)
        blocks = torch.cat([m.blocks if x4 else m.plain_blocks() for m in modules], dim=0)
        return cls(first.type_name, blocks, first.in_features, sum(m.out_features for m in modules), x4=x4)

    def dequantized(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The float32 weight rows [start:stop] (default all: [out_features, in_features])."""
        stop = self.out_features if stop is None else stop
        if self.x4:  # whole groups, then the rows asked for
            g = self.group
            lo, hi = start // g * g, min(self.out_features, -(-stop // g) * g)
            groups = torch.ops.runlm.gguf_dequantize(self.blocks[lo:hi], self.type_id, hi - lo, self.in_features)
            return groups[start - lo : stop - lo]
        blocks = self.blocks[start:stop]
        shape = (blocks.shape[0], self.in_features)
        if self._kernel:
            return torch.ops.runlm.gguf_dequantize(blocks, self.type_id, shape[0], shape[1])
        return dequantize(self.type_name, blocks, shape)

    def gathered(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `ids` [n] -> [n, in_features]: a tied LM head serving the embedding lookup."""
        ids = ids.reshape(-1).cpu().long()
        if self._kernel:  # one call, straight from either layout (a decode step looks up one row)
            return torch.ops.runlm.gguf_dequantize_rows(self.blocks, self.type_id, self.out_features,
                                                        self.in_features, ids)
        return dequantize(self.type_name, self.blocks[ids], (ids.numel(), self.in_features))

    def _dense(self, x2: torch.Tensor) -> torch.Tensor:
        rows = max(4, _DENSE_CHUNK_ELEMENTS // self.in_features // 4 * 4)
        if self.out_features <= rows:
            return F.linear(x2, self.dequantized())
        parts = [F.linear(x2, self.dequantized(i, i + rows)) for i in range(0, self.out_features, rows)]
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fast path (decode): float32 input, few rows; the op takes any leading dims
        if self._kernel and x.dtype == torch.float32 and x.numel() < self.dense_min_rows * self.in_features:
            return torch.ops.runlm.gguf_linear.default(
                x, self.blocks, self.type_id, self.out_features, self.in_features
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.to(torch.float32)
        x2 = x2.contiguous()
        if self._kernel and x2.shape[0] < self.dense_min_rows:
            y = torch.ops.runlm.gguf_linear(x2, self.blocks, self.type_id, self.out_features, self.in_features)
        else:
            y = self._dense(x2)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        layout = ", layout=x4" if self.x4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name}{layout}"


def gguf_linear_module(
    type_name: str, data: np.ndarray | torch.Tensor, shape: Sequence[int], interleave: bool = True
) -> nn.Module | None:
    """A GGUFLinear for a GGUF weight of row-major `shape` (out_features, in_features), or None.

    None when the kernels are unavailable (build failed / disabled) or there is no kernel for this type / shape:
    the caller should use `runlm.pytorch.int4.make_linear` instead. The bytes are copied (`data` may change after).
    `interleave`: in the x4 layout where the type has one (see GGUFLinear.interleaved).
    """
    if len(shape) != 2:
        return None
    return gguf_linear_from_parts([_OwnedRows(type_name, data, shape)], interleave)


def gguf_linear_from_parts(parts: Sequence[WeightRows], interleave: bool = True) -> GGUFLinear | None:
    """One GGUFLinear for GGUF weights stacked along the output dim, built by `GGUFLinear.from_parts` (one buffer,
    read from the file rather than through its map), or None where `gguf_linear_module` would give None for one of
    them or they differ in type or width (then build them one by one)."""
    parts = list(parts)
    if not parts or len({(normalize_type_name(p.type_name), tuple(p.shape[1:])) for p in parts}) != 1:
        return None
    name, shape = normalize_type_name(parts[0].type_name), parts[0].shape
    if name not in KERNEL_TYPES or len(shape) != 2 or any(int(p.shape[0]) <= 0 for p in parts):
        return None
    if int(shape[1]) <= 0 or int(shape[1]) % BLOCK_LAYOUTS[name][0] or not available():
        return None
    return GGUFLinear.from_parts(name, parts, interleave=interleave)


def concat_gguf_linears(modules: Sequence[nn.Module]) -> GGUFLinear | None:
    """One GGUFLinear for `modules` stacked along the output dim, or None if they are not all GGUFLinear of one
    type and in_features (then use `runlm.pytorch.int4.concat_linears`)."""
    modules = list(modules)
    if not modules or not all(isinstance(m, GGUFLinear) for m in modules):
        return None
    if len({(m.type_name, m.in_features) for m in modules}) != 1:
        return None
    return GGUFLinear.cat(modules)  # type: ignore[arg-type]
