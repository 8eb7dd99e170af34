"""A GGUF file's weights as runlm's kernels read them, made at load without PyTorch and without a second file.

Projections that this build regroups into the interleaved layouts (`relayout`, as llama.cpp's CPU repack does) are
copied out of the file into memory of their own, regrouped in C: from the map a chunk at a time, each chunk's pages
let go after it, or with pread, so the load holds no file pages beside its copy. The others (float weights, and
quantized types kept in the file's row layout) are read where the file maps them, as llama.cpp reads every weight.
Every tensor's shape is checked against the model's hyperparameters, and its type against what the kernels run, before
a byte of it is read; the GGUF reader has already checked that its bytes lie within the file. The choice of which
weights take the interleaved layout is the PyTorch backend's (runlm.pytorch.kernels.GGUFLinear.from_parts), so both
compute the same bits.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runlm.errors import ModelLoadError
from runlm.families.config import ModelConfig, expected_shapes
from runlm.families.spec import FamilySpec
from runlm.formats.gguf import GGUFFile, RawTensor, gguf_name
from runlm.native import library
from runlm.native.build import BLOCK_LAYOUTS, FLOAT_KERNEL_TYPES, KERNEL_TYPES, RUN_TYPES, X4, X4_TYPES
from runlm.system import HUGE_PAGE_BYTES, free_huge_page_bytes

_FLOAT_IDS = {type_id: name for name, type_id in FLOAT_KERNEL_TYPES.items()}
# Bytes of a weight read and regrouped at a time, through one scratch buffer kept for the load.
_CHUNK_BYTES = 4 << 20
# Free 2 MiB blocks left to the rest of the machine when weights take huge pages.
_HUGE_SPARE = 256 << 20
# The smallest weight whose huge pages' making is timed (bytes), and the rate below which they are given up (bytes/s)
_HUGE_FILL_PROBE = 8 << 20
_HUGE_FILL_FLOOR = 2.0e9
# madvise's MADV_POPULATE_WRITE (Linux 5.14; Python's mmap module names it from 3.13) and MADV_COLLAPSE (Linux 6.1)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)


class NativeRefusal(ModelLoadError):
    """The model cannot run on the native runtime (the message says why): a property of the model, not a failure.
    Callers that may fall back to the PyTorch backend do."""


@dataclass
class Part:
    """Rows of one projection as the kernels take them: GGUF blocks `data` [rows, row bytes] of kernel type id
    `type_id` (+ X4: the interleaved layout)."""

    data: np.ndarray
    type_id: int
    rows: int

    def weight(self) -> library.Weight:
        return library.Weight(library.address(self.data), self.type_id, self.rows)


class WeightReader:
    """Named weights (Hugging Face names, the spec's GGUF renames) of one GGUF file, checked and laid out."""

    def __init__(self, gguf: GGUFFile, spec: FamilySpec, config: ModelConfig):
        self.gguf, self.spec, self.config = gguf, spec, config
        self.expect = expected_shapes(config, spec.qk_norm_whole)
        self._scratch = np.empty(0, dtype=np.uint8)
        self._huge_pages = True  # while huge pages fill fast enough (see _part)
        self.small_pages: list[np.ndarray] = []  # regrouped weights left in 4 KiB pages, for HugePages

    def has(self, name: str) -> bool:
        return self.gguf.has(gguf_name(name, self.spec.gguf_names))

    def raw(self, name: str) -> RawTensor:
        stored_as = gguf_name(name, self.spec.gguf_names)
        shape = self.gguf.shape(stored_as)
        want = self.expect(name)
        if want is not None and tuple(shape) != tuple(want):
            raise ModelLoadError(f"{self.gguf.path}: tensor {stored_as!r} has shape {list(shape)}, the model's "
                                 f"hyperparameters call for {list(want)}")
        raw = self.gguf.raw(stored_as)
        if raw.type_name not in BLOCK_LAYOUTS:
            raise ModelLoadError(f"{self.gguf.path}: tensor {raw.name!r} is stored as {raw.type_name}, a type runlm "
                                 f"cannot read (it reads: {', '.join(BLOCK_LAYOUTS)})")
        return raw

    def floats(self, name: str) -> np.ndarray:
        """A small tensor (a norm's weights) as float32, a copy of its own."""
        raw = self.raw(name)
        if raw.type_name in FLOAT_KERNEL_TYPES:
            stored = raw.read_rows(0, max(1, int(np.prod(raw.shape[:-1]))))
            return widened(stored, raw.type_name).reshape(raw.shape)
        if raw.type_name in KERNEL_TYPES and len(raw.shape) == 1:
            row = raw.read_rows(0, 1)
            return library.dequantize_rows(row, KERNEL_TYPES[raw.type_name], 1, raw.shape[0], np.zeros(1))[0]
        raise NativeRefusal(f"its tensor {raw.name!r} is stored as {raw.type_name}, which the native runtime does not "
                            f"read as floats")

    def bias(self, names: Sequence[str]) -> np.ndarray | None:
        """The biases of a projection stacked as `linear` stacks its weights (rows put back as the spec's order
        puts the weights' back), or None where the file has none; a file with only some of them is refused."""
        present = [self.has(name) for name in names]
        if not any(present):
            return None
        if not all(present):
            missing = [gguf_name(n, self.spec.gguf_names) for n, here in zip(names, present) if not here]
            raise ModelLoadError(f"{self.gguf.path}: has some of a projection's biases but not {', '.join(missing)}")
        parts = []
        for name in names:
            values = self.floats(name)
            order = self.spec.qk_rows_order(name, self.config)
            parts.append(values if order is None else values[order])
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)

    def linear(self, names: Sequence[str]) -> list[Part]:
        """One projection from weights stacked along the output dimension (q/k/v, gate/up): one part where they
        share a type and width (interleaved where every one has whole groups), else one part each."""
        return self._linear([self.raw(name) for name in names],
                            [self.spec.qk_rows_order(name, self.config) for name in names])

    def experts(self, names: Sequence[str]) -> list[list[Part]]:
        """Every expert's projection from tensors of all the experts' weights ([experts, rows, cols] each, stacked
        along the output dimension as `linear` stacks them): one list of parts per expert."""
        raws = [self.raw(name) for name in names]
        return [self._linear([raw.expert(index) for raw in raws], [None] * len(raws))
                for index in range(raws[0].shape[0])]

    def _linear(self, raws: list[RawTensor], orders: list[list[int] | None]) -> list[Part]:
        for raw in raws:
            if raw.type_name not in RUN_TYPES or len(raw.shape) != 2:
                raise NativeRefusal(f"its tensor {raw.name!r} is stored as {raw.type_name}, which runlm's kernels do "
                                    f"not run")
        in_place = [self._in_place(raw, order) for raw, order in zip(raws, orders)]
        if all(in_place):
            # read where the file maps them: float weights, and quantized ones this build keeps in the file's row
            # layout, whose kernels take the rows as they are; a copy cost a load its size in page faults (Qwen2.5-1.5B
            # at F16 on an EPYC Zen 4: 6.6 s to load copied, 0.36 s mapped, decode steps 8.1 tok/s mapped against 8.9
            # copied; at IQ4_XS with the avx2 build 0.71 s against 0.14, decode even over 8 alternating rounds)
            return [self._mapped(raw) for raw in raws]
        if len({(raw.type_name, raw.shape[1]) for raw in raws}) == 1:
            return [self._part(raws, orders)]
        return [self._mapped(raw) if here else self._part([raw], [order])
                for raw, order, here in zip(raws, orders, in_place)]

    def _in_place(self, raw: RawTensor, order: list[int] | None) -> bool:
        """Whether the kernels can take this weight's rows where the file maps them: float, or quantized in a type
        this build does not regroup, its rows in the file's order."""
        return raw.mapped and order is None and not self._group(raw.type_name, [raw])  # floats have no groups

    def _mapped(self, raw: RawTensor) -> Part:
        _row_bytes(raw)
        return Part(raw.mapped_rows(0, raw.shape[0]), RUN_TYPES[raw.type_name], raw.shape[0])

    @staticmethod
    def _group(type_name: str, raws: list[RawTensor]) -> int:
        """Rows of the interleaved groups this build regroups the weights into, or 0 where it keeps the row layout."""
        group = library.group_rows(RUN_TYPES[type_name]) if type_name in X4_TYPES and library.simd() else 0
        return group if group and all(raw.shape[0] % group == 0 for raw in raws) else 0

    def _part(self, raws: list[RawTensor], orders: list[list[int] | None]) -> Part:
        type_name, cols = raws[0].type_name, raws[0].shape[1]
        row_bytes = _row_bytes(raws[0])
        type_id = RUN_TYPES[type_name]
        group = self._group(type_name, raws)
        x4 = group > 0
        total = sum(raw.shape[0] for raw in raws)
        out, huge_rate = weight_buffer(total, row_bytes, self._huge_pages)
        if huge_rate is not None and out.nbytes >= _HUGE_FILL_PROBE:
            # Where the kernel makes each huge page from memory its host has not backed (a VM that hands free 2 MiB
            # blocks back to its host: 1B Q8_0 loaded in 2.5 s against 0.9 in small pages), the rest of the load
            # goes without them.
            self._huge_pages = huge_rate >= _HUGE_FILL_FLOOR
        if out.nbytes >= HUGE_PAGE_BYTES and (huge_rate is None or huge_rate < _HUGE_FILL_FLOOR):
            self.small_pages.append(out)
        first = 0
        for raw, order in zip(raws, orders):
            rows = raw.shape[0]
            target = out[first : first + rows]
            if order is not None:  # the whole weight, its rows put back, then regrouped
                if raw.mapped:  # gathered from the map in one pass (into place where nothing is regrouped)
                    stored = np.take(raw.mapped_rows(0, rows), order, axis=0, out=None if x4 else target, mode="clip")
                else:
                    stored = raw.read_rows(0, rows)[order]
                if x4:
                    library.relayout(stored, type_id, rows, cols, target)
                elif stored is not target:
                    target[...] = stored
                if raw.mapped:
                    raw.release_rows(0, rows)
            elif not x4:
                raw.read_rows(0, rows, target)
            else:
                step = max(group, _CHUNK_BYTES // row_bytes // group * group)
                for start in range(0, rows, step):
                    stop = min(rows, start + step)
                    if raw.mapped:  # regrouped straight from the map, whose pages then go
                        library.relayout(raw.mapped_rows(start, stop), type_id, stop - start, cols,
                                         target[start:stop])
                        raw.release_rows(start, stop)
                    else:
                        chunk = raw.read_rows(start, stop, self._scratch_rows(stop - start, row_bytes))
                        library.relayout(chunk, type_id, stop - start, cols, target[start:stop])
            first += rows
        return Part(out, type_id + (X4 if x4 else 0), total)

    def _scratch_rows(self, rows: int, row_bytes: int) -> np.ndarray:
        if self._scratch.size < rows * row_bytes:
            self._scratch = np.empty(max(_CHUNK_BYTES, rows * row_bytes), dtype=np.uint8)
        return self._scratch[: rows * row_bytes].reshape(rows, row_bytes)


def _row_bytes(raw: RawTensor) -> int:
    """Bytes of one of the weight's rows, which must be whole blocks of its type."""
    block_values, block_bytes = BLOCK_LAYOUTS[raw.type_name]
    if raw.shape[1] % block_values:
        raise NativeRefusal(f"its tensor {raw.name!r} has rows of {raw.shape[1]} values, not whole {raw.type_name} "
                            f"blocks")
    return raw.shape[1] // block_values * block_bytes


def weight_buffer(rows: int, row_bytes: int, huge_pages: bool = True) -> tuple[np.ndarray, float | None]:
    """A [rows, row_bytes] byte array for regrouped weights, in private memory of its own mapping, and the rate
    (bytes/s) at which the kernel made its transparent huge pages where it has them, else None.

    Huge pages are asked for where `huge_pages` and the kernel has free 2 MiB blocks for all of it. Decode streams
    every weight once a token, and from huge pages it ran faster (EPYC Zen 4, 1B shapes, the same process alternating
    two copies of the model, both load orders): Q8_0 1.09-1.24x (avx512), Q4_K_M 1.09-1.17x (avx2), 1.02-1.04x
    (avx512); prefill the same. Where the blocks would have to be made by compaction, each first write to 2 MiB stalls
    (a 2-core VM filled weights at ~0.3 GB/s against ~1.5 GB/s in 4 KiB pages): those buffers keep 4 KiB pages. The
    huge pages are made up front and timed: from memory in use before, the kernel makes them at 5-10 GB/s; from
    memory a VM's host backs only at first touch, at ~0.6 GB/s (see _make_huge_pages)."""
    nbytes = rows * row_bytes
    if nbytes == 0:
        return np.empty((rows, row_bytes), dtype=np.uint8), None
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    rate = None
    if (huge_pages and nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE")
            and free_huge_page_bytes() >= nbytes + _HUGE_SPARE):
        mapping.madvise(mmap.MADV_HUGEPAGE)
        rate = _make_huge_pages(mapping, nbytes)
    return np.frombuffer(mapping, dtype=np.uint8).reshape(rows, row_bytes), rate


def _make_huge_pages(mapping: mmap.mmap, nbytes: int) -> float | None:
    """Make the huge pages of `mapping` (asked for with MADV_HUGEPAGE) _HUGE_FILL_PROBE bytes at a time, each step
    timed; after a whole step made below _HUGE_FILL_FLOOR the rest goes in 4 KiB pages (MADV_NOHUGEPAGE), so a slow
    host costs one step and not the whole weight (Gemma 3 270M's 178 MB table took 0.34 s in huge pages made at 0.53
    GB/s). The rate, bytes/s: that slow step's, else the whole buffer's; None where the kernel cannot make pages up
    front (before 5.14: the pages then come at first write)."""
    done, spent = 0, 0.0
    while done < nbytes:
        size = min(_HUGE_FILL_PROBE, nbytes - done)
        started = time.perf_counter()
        try:
            mapping.madvise(_MADV_POPULATE_WRITE, done, size)
        except OSError:
            return None
        took = max(time.perf_counter() - started, 1e-9)
        done, spent = done + size, spent + took
        if size == _HUGE_FILL_PROBE and size / took < _HUGE_FILL_FLOOR:
            if done < nbytes:
                mapping.madvise(mmap.MADV_NOHUGEPAGE, done, nbytes - done)
            return size / took
    return nbytes / spent


class HugePages:
    """Regrouped weights that loaded in 4 KiB pages, made into huge pages afterwards by a thread of idle priority
    (MADV_COLLAPSE, 2 MiB at a time), so the load stays fast and decode gains once the cores have had idle time.

    A VM that hands its free memory back to the host makes each new huge page at ~0.1 GB/s, so the load gives them
    up (see _make_huge_pages); collapsing them later costs the same, but off the load's path. Once made, decode ran
    1.3x faster (Xeon VM, avx2, 1B Q4_K_M: 23.7 -> 31.2 tok/s; 760 MB collapsed in 9 s). The thread has idle
    priority, but a core stalled in the host is lost to the model too: beside a decode loop the same took ~18 s, and
    decode ran ~15% slower meanwhile. A kernel without MADV_COLLAPSE (before 6.1) ends it at the first call."""

    def __init__(self, buffers: list[np.ndarray]):
        self._buffers = buffers
        self._stop = threading.Event()
        self.done = threading.Event()
        self.seconds: float | None = None  # from the thread's start to its end
        self.collapsed_bytes = 0
        self._thread = threading.Thread(target=self._run, name="runlm-huge-pages", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every buffer has been tried, waiting up to `timeout` seconds."""
        return self.done.wait(timeout)

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            _idle_priority()
            madvise = _libc_madvise()
            for buffer in self._buffers:
                start = -(-buffer.ctypes.data // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
                end = (buffer.ctypes.data + buffer.nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
                if end <= start:
                    continue
                if madvise is None or madvise(start, end - start, mmap.MADV_HUGEPAGE) != 0:
                    return
                for address in range(start, end, HUGE_PAGE_BYTES):
                    if self._stop.is_set():
                        return
                    if madvise(address, HUGE_PAGE_BYTES, _MADV_COLLAPSE) == 0:
                        self.collapsed_bytes += HUGE_PAGE_BYTES
                    elif ctypes.get_errno() == errno.EINVAL:  # no MADV_COLLAPSE in this kernel
                        return
        finally:
            self._buffers = []
            self.seconds = time.perf_counter() - started
            self.done.set()


def _idle_priority() -> None:
    """Run the calling thread (on Linux, the thread alone) only where a core would otherwise idle."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or refused
        pass


def _libc_madvise():
    """The C library's madvise, called without holding the GIL (Python's mmap.madvise holds it), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return function


def huge_pages_later(buffers: list[np.ndarray]) -> HugePages | None:
    """A HugePages thread for `buffers`, or None where there are none or the machine has no huge pages."""
    if not buffers or not hasattr(mmap, "MADV_HUGEPAGE") or not os.path.exists("/sys/kernel/mm/transparent_hugepage"):
        return None
    return HugePages(buffers)


def widened(stored: np.ndarray, type_name: str) -> np.ndarray:
    """Float weights' bytes (F32, F16 or BF16) as float32 values, a copy."""
    if type_name == "BF16":
        return (np.ascontiguousarray(stored).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(stored).view(np.float32 if type_name == "F32" else np.float16).astype(np.float32)


@dataclass
class Rows:
    """A table looked up by row (the token embedding) or multiplied (the LM head), as the kernels read it."""

    blocks: Part
    width: int

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        float_type = _FLOAT_IDS.get(self.blocks.type_id)
        if float_type is not None:
            return widened(self.blocks.data[ids], float_type).reshape(len(ids), self.width)
        return library.dequantize_rows(self.blocks.data, self.blocks.type_id, self.blocks.rows, self.width, ids)

    def multiply(self, x: np.ndarray) -> np.ndarray:
        """x [R, width] @ table.T: [R, rows]."""
        return library.linear(x, self.blocks.data, self.blocks.type_id, self.blocks.rows)


def table(reader: WeightReader, name: str, as_head: bool) -> Rows:
    """The embedding (as_head False) or LM head (True) `name`: the head as a projection (interleaved where its type
    has a layout for it), an embedding from the file's map."""
    raw = reader.raw(name)
    width = raw.shape[1]
    if raw.type_name not in RUN_TYPES:
        raise NativeRefusal(f"its tensor {raw.name!r} is stored as {raw.type_name}, which runlm's kernels do not read")
    if as_head:
        return Rows(blocks=reader.linear([name])[0], width=width)
    blocks = raw.data.view(np.uint8).reshape(raw.shape[0], -1)  # F32 / F16 data comes typed
    return Rows(blocks=Part(blocks, RUN_TYPES[raw.type_name], raw.shape[0]), width=width)


__all__ = ["HugePages", "NativeRefusal", "Part", "RUN_TYPES", "Rows", "WeightReader", "huge_pages_later", "table",
           "weight_buffer", "widened"]
