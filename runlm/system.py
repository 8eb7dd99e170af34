"""What runlm reads of the machine it runs on: the CPU's name and flags, and memory (Linux's /proc; elsewhere the
answers degrade to what `platform` knows, or None), and the two things it asks of the C library."""

from __future__ import annotations

import ctypes
import gc
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _first_block(path: str) -> dict[str, str]:
    """The "key: value" lines of a /proc file up to its first blank line (/proc/cpuinfo: the first CPU; /proc/meminfo:
    all of it), or {} where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where Linux gives them (a VM often shows only "AMD
    EPYC": family 25 is Zen 3 / 4, 26 Zen 5)."""
    cpu = _first_block("/proc/cpuinfo")
    name = cpu.get("model name") or platform.processor() or platform.machine()
    family, model = cpu.get("cpu family"), cpu.get("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it ("GenuineIntel", "AuthenticAMD"; "" where unknown)."""
    return _first_block("/proc/cpuinfo").get("vendor_id", "")


def cpu_family() -> int | None:
    """The CPU's family number as /proc/cpuinfo gives it (AMD: 23 Zen 1 / 2, 25 Zen 3 / 4, 26 Zen 5), None where
    unknown."""
    family = _first_block("/proc/cpuinfo").get("cpu family", "")
    return int(family) if family.isdigit() else None


def cpu_flags() -> str:
    """The first CPU's feature flags as /proc/cpuinfo lists them ("" where unknown; "Features" on ARM)."""
    cpu = _first_block("/proc/cpuinfo")
    return cpu.get("flags") or cpu.get("Features") or ""


def meminfo_bytes(field: str) -> int | None:
    """A /proc/meminfo field ("MemTotal", "MemAvailable") in bytes, or None where it cannot be read."""
    try:
        return int(_first_block("/proc/meminfo")[field].split()[0]) * 1024
    except (KeyError, ValueError, IndexError):
        return None


HUGE_PAGE_BYTES = 2 << 20  # x86-64's and (with 4 KiB base pages) arm64's PMD size
_HUGE_PAGE_ORDER = 9  # 2 MiB in 4 KiB pages: the buddy order a huge page is taken from


def free_huge_page_bytes(buddyinfo: str | None = None) -> int:
    """Bytes the kernel could hand out as 2 MiB huge pages right now without compacting memory: its free blocks of
    2 MiB and larger, summed over every zone (/proc/buddyinfo; 0 where it cannot be read). A huge page requested
    beyond these is made by compaction, which stalls the faulting thread (see no_numpy_huge_pages)."""
    if buddyinfo is None:
        try:
            with open("/proc/buddyinfo", encoding="ascii") as handle:
                buddyinfo = handle.read()
        except OSError:
            return 0
    total = 0
    for line in buddyinfo.splitlines():
        counts = line.partition("zone")[2].split()[1:]  # after the zone's name: free blocks of order 0, 1, ...
        for order, count in enumerate(counts):
            if order >= _HUGE_PAGE_ORDER and count.isdigit():
                total += int(count) << (order + 12)
    return total


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere). Loading frees hundreds
    of MB in small pieces (the tokenizer's build, the GGUF metadata), and glibc returns only the top of its heap by
    itself: without this, Gemma's tokenizer alone leaves ~190 MB resident that nothing uses."""
    trim = _libc_function("malloc_trim", [ctypes.c_size_t])
    if trim is not None:
        trim(0)


@contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cycle collector off for a block that makes hundreds of thousands of objects and frees none of them in
    cycles (a tokenizer's vocabulary and merges): each collection would walk all of them again, 0.4 s of Gemma 3's
    262k-piece tokenizer build. Reference counting still frees everything; the collector comes back after, where it
    was on."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


# glibc's mallopt parameters, and the values steady_heap sets
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit
HEAP_TRIM_THRESHOLD = 64 << 20


def steady_heap() -> None:
    """Keep allocations up to 32 MiB on the C heap, and up to 64 MiB of its free top for the next forward, instead
    of glibc's adaptive thresholds (a no-op elsewhere). A forward's activation buffers (the fused blocks' std::vectors,
    up to ~16 MiB each for a 256-token chunk at 1B) are otherwise often mapped fresh and unmapped per block: without
    them, one 512-token prefill at the 1B Q4_K_M shape faulted ~250k pages (a GiB) in some processes and few in
    others; with these thresholds ~2k, and prefill ran 1.1-1.35x faster, peak RSS unchanged (1B Q4_K_M, Q8_0,
    Gemma 3 270M). numpy's large arrays go without huge pages too (no_numpy_huge_pages)."""
    mallopt = _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
        mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)
    no_numpy_huge_pages()


def no_numpy_huge_pages() -> None:
    """Stop numpy asking for transparent huge pages on its large arrays. Where the kernel grants them on request with
    synchronous compaction (THP "madvise" for both enabled and defrag), every first write to 2 MiB
    of a fresh array stalls: a 640-token prompt's logits over Gemma 3's 262k vocabulary (670 MB, every position, as
    perplexity and the tests read them) took 15 s, 14 of them in the kernel; 1.4 s without the request."""
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1.x
        from numpy.core import multiarray
    switch = getattr(multiarray, "_set_madvise_hugepage", None)
    if switch is not None:
        switch(False)


def _libc_function(name: str, argtypes: list) -> ctypes._CFuncPtr | None:
    """The C library's `name` (returning int), or None where there is none (glibc's extensions elsewhere)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def python_command(*args: str) -> list[str]:
    """A command line that runs this Python without the current directory on its import path: `python -m x` and
    `python -c` put it first, so a planted `numpy.py` (in a downloaded model's folder, say) would run. -P (Python
    3.11+) leaves it off and nothing else; 3.10 has only -I, which also drops PYTHON* variables and the user site."""
    return [sys.executable, "-P" if sys.version_info >= (3, 11) else "-I", *args]
