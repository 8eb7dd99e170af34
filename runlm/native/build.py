"""How runlm's C++ kernels (kernels.cpp) are compiled and tuned, for both of their builds: the PyTorch extension
(runlm.pytorch.kernels) and the standalone library of the decode process without torch (runlm.native.library). Importing
this module does not import torch.

Environment: RUNLM_GGUF_KERNELS=0 disables the kernels; =scalar picks the portable scalar path, =avx2 the AVX2 path
without AVX-512 (what an AVX2-only CPU runs), =avxvnni that with AVX-VNNI, instead of the best this CPU runs
(ISA_VARIANTS).
RUNLM_DECODE_WALK=line|burst picks how the 16-row kernels prefetch a decode GEMV's weights instead of the CPU's
default (`DECODE_WALKS`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

from runlm.system import cpu_family, cpu_flags, cpu_vendor

# GGML type name -> type id (gguf.GGMLQuantizationType values), for every type the kernels implement.
KERNEL_TYPES: dict[str, int] = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q2_K": 10,
    "Q3_K": 11,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "MXFP4": 39,
    "IQ4_NL": 20,
    "IQ4_XS": 23,
}
# Float weight types the kernels run in float32 (float_gemm.h), read in the file's layout.
FLOAT_KERNEL_TYPES: dict[str, int] = {"F32": 0, "F16": 1, "BF16": 30}
# Every weight type the kernels run: the GGUF block types and the float types.
RUN_TYPES: dict[str, int] = {**KERNEL_TYPES, **FLOAT_KERNEL_TYPES}

QK_K = 256
# GGUF type name -> (values per block, bytes per block), for every type runlm reads.
BLOCK_LAYOUTS: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (QK_K, 84),
    "Q3_K": (QK_K, 110),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (QK_K, 136),
    "MXFP4": (32, 17),
}

# Types with the interleaved ("x4") layout (type id + X4 in kernels.cpp): same bytes, regrouped once at load so that
# a GEMV reads one stream and decodes 4 rows' scales and 2 rows' codes per instruction (32-wide types 1.1-1.5x faster;
# Q4_K / Q5_K ~2-2.5x at one activation row, ~1.5-2x at many; Q6_K ~1.1-1.2x; all bit-identical to the row layout).
# Groups are 4 rows, except in an AVX-512 build: 16 rows, for the 512-bit kernels (`group_rows`). IQ4_XS has 16-row
# groups only: its 4-row AVX2 kernel would do the row kernel's work per value, in the same instructions.
X4 = 256  # added to a type id: the weight is in the interleaved layout (kernels.cpp's X4)
X4_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
# The kernels' one translation unit, and every file of it (its parts, split by concern, in runlm/native/csrc)
SOURCE = Path(__file__).resolve().parent / "csrc" / "kernels.cpp"
SOURCES = sorted(SOURCE.parent.glob("*.[ch]*"))
CFLAGS = ["-O3", "-fopenmp"]
# what makes kernels.cpp the plain shared library of the native runtime (no PyTorch)
STANDALONE_FLAGS = ["-std=c++20", "-DRUNLM_STANDALONE"]
# The instruction-set variants of the kernels: one shared library each, all built when runlm is installed, the best
# this CPU runs chosen at run time (as ggml's GGML_CPU_ALL_VARIANTS). name -> (compiler flags, the /proc/cpuinfo
# flags a CPU needs for the code those flags let the compiler emit). Best first. Each is tuned for the machine that
# builds it (-mtune only schedules: any CPU with the variant's instructions runs it); the tuning also decides some
# floating-point contractions, so both builds on a machine (this library and the PyTorch extension) share it.
ISA_VARIANTS: dict[str, tuple[list[str], frozenset[str]]] = {
    "amx": (["-march=x86-64-v4", "-mavx512vnni", "-mamx-tile", "-mamx-int8", "-mtune=native"],
            frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "amx_tile",
                       "amx_int8"})),
    "avx512": (["-march=x86-64-v4", "-mavx512vnni", "-mtune=native"],
               frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"})),
    # AVX2 with the VEX-encoded VNNI dot products (Intel since Alder Lake, AMD since Zen 5): 4-row groups, as avx2
    "avxvnni": (["-march=x86-64-v3", "-mavxvnni", "-mtune=native"],
                frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "avx_vnni"})),
    "avx2": (["-march=x86-64-v3", "-mtune=native"],
             frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe"})),
    "scalar": (["-DRUNLM_SCALAR", "-mtune=native"], frozenset()),
}
# 64-bit ARM: NEON integer dots, with SDOT where the CPU has the dotprod extension ("asimddp" in /proc/cpuinfo's
# Features: Apple M1 on, Graviton 2 on, Cortex-A76 on), plain NEON widening multiplies otherwise; the same bits as the
# scalar path (tests/native/test_arm_kernels.py runs them under qemu-user).
ARM_VARIANTS: dict[str, tuple[list[str], frozenset[str]]] = {
    "dotprod": (["-march=armv8.2-a+dotprod"], frozenset({"asimd", "asimddp"})),
    "neon": (["-march=armv8-a"], frozenset({"asimd"})),
    "scalar": (["-DRUNLM_SCALAR"], frozenset()),
}
# elsewhere: the compiler's own choice for this CPU, and the portable scalar path
OTHER_VARIANTS: dict[str, list[str]] = {"native": ["-march=native"], "scalar": ["-DRUNLM_SCALAR"]}
ENV_VAR = "RUNLM_GGUF_KERNELS"
WALK_ENV_VAR = "RUNLM_DECODE_WALK"
# How the interleaved kernels prefetch and walk a decode GEMV's weights: (line_ahead bytes, burst distance bytes for
# the 256-value super-blocks (K-quants, IQ4_XS), for the 32-value block types, groups per thread for the former, for
# the latter); kernels.cpp's DecodeWalk has the measurements. The results do not depend on it.
DECODE_WALKS: dict[str, tuple[int, int, int, int, int]] = {
    # a prefetch 2 KiB on with each weight line, two groups per thread: Intel Xeon's best
    "line": (2048, 0, 0, 2, 2),
    # that, and the super-block >= 2 KiB on, whole, before each decode step; one K-quant group per thread: AMD Zen 5's
    # for its 16-row kernels (decode_walk_name)
    "burst": (2048, 2048, 2048, 1, 2),
    # the burst for the 32-value block types only: AMD Zen 4's for its 16-row kernels
    "burst-32": (2048, 0, 2048, 2, 2),
}

# A q8_0 KV cache row: blocks of 32 values in 34 bytes (f16 scale + 32 int8), kernels.cpp's KvQ8Block.
Q8_0_VALUES, Q8_0_BYTES = 32, 34

log = logging.getLogger("runlm.kernels")


def x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def aarch64() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def _dispatched() -> dict[str, tuple[list[str], frozenset[str]]] | None:
    """This architecture's variants chosen by CPU flags (None: the compiler's own choice)."""
    return ISA_VARIANTS if x86_64() else ARM_VARIANTS if aarch64() else None


def variants() -> dict[str, list[str]]:
    """Every variant of this architecture and its compiler flags (on top of CFLAGS)."""
    table = _dispatched()
    return dict(OTHER_VARIANTS) if table is None else {name: flags for name, (flags, _) in table.items()}


def best_variant(flags: str | None = None) -> str:
    """The best variant a CPU with these /proc/cpuinfo `flags` (default: this one's) runs."""
    table = _dispatched()
    if table is None:
        return "native"
    have = set((cpu_flags() if flags is None else flags).split())
    return next(name for name, (_, needs) in table.items() if needs <= have)


def variant() -> str:
    """The build RUNLM_GGUF_KERNELS asks for: the best this CPU runs (default, or "native"), a variant by name
    ("avx2", "scalar", ...: for testing what other CPUs run), or "off"."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    return value if value in variants() else best_variant()


def variant_cflags(name: str | None = None) -> list[str]:
    """The compiler flags of a variant (default: this process's)."""
    return CFLAGS + variants().get(name or variant(), [])


def source_key(name: str) -> str:
    """What a build of variant `name` is made of (the kernel source and its flags), hashed: a library built at
    install carries it (rl_source_key), so one built from an older source is never loaded."""
    key = hashlib.sha1()
    for source in SOURCES:
        key.update(source.read_bytes())
    key.update(" ".join(variant_cflags(name)).encode())
    return key.hexdigest()[:16]


def build_key(*extra: str) -> str:
    """A short hash of what a build depends on: the CPU's features (a -march=native build is only reused on the same
    kind of CPU), the kernel source and where it lies, this process's flags and `extra` (torch's version, for the
    extension). Two checkouts or versions of runlm on one machine then keep builds of their own, instead of
    rebuilding over (and loading) each other's in one directory: torch's build file names the source by its path,
    so two checkouts of the same source would otherwise each find the other's build stale."""
    key = hashlib.sha1(f"{platform.machine()}|{platform.processor()}|{cpu_flags()}|{variant_cflags()}|{extra}|"
                       f"{SOURCE.parent}".encode())
    for source in SOURCES:
        key.update(source.read_bytes())
    return key.hexdigest()[:12]


def decode_walk_name(isa: str) -> str:
    """RUNLM_DECODE_WALK where it names a walk, else the one measured best for a build for instruction set `isa` on
    this CPU: for the 16-row kernels (AVX-512 builds) on AMD "burst" (Zen 5: 1.46-1.59x the line walk's decode), but
    "burst-32" on Zen 4 (family 25: its K-quant decode 1.08-1.10x the burst walk's, Q8_0 keeping the burst); "line"
    everywhere else. The 4-row groups of the AVX2 builds decode faster on the line walk on every CPU measured: 1B
    Q4_K_M decode steps 1.09-1.19x the burst walk's on an Intel Xeon, 1.7x on an AMD EPYC Zen 1 (10.2 -> 17.5 tok/s,
    2 threads), where the burst's prefetch of each whole group before its kernel halved a GEMV's read rate."""
    asked = os.environ.get(WALK_ENV_VAR, "").strip().lower()
    if asked in DECODE_WALKS:
        return asked
    if asked not in ("", "auto"):
        log.warning("runlm: %s=%s is not a decode walk (%s, auto); using the CPU's", WALK_ENV_VAR, asked,
                    ", ".join(DECODE_WALKS))
    if not isa.startswith("avx512") or cpu_vendor() != "AuthenticAMD":
        return "line"
    return "burst-32" if cpu_family() == 25 else "burst"


def walks_weights(isa: str) -> bool:
    """Whether a build for instruction set `isa` prefetches and walks a decode GEMV's weights (the x86 SIMD builds'
    interleaved groups), so that a decode walk applies to it."""
    return isa.startswith(("avx512", "avx2", "avx-vnni"))


def decode_walk_summary(isa: str) -> str:
    """The decode walk of a build for instruction set `isa` in words (`runlm info --system`), or why it has none."""
    if not walks_weights(isa):
        return "none: this build has no interleaved groups"
    walk = decode_walk_name(isa)
    line, kquant_burst, wide32_burst, kquant_streams, wide32_streams = DECODE_WALKS[walk]
    how = f"a prefetch {line} B on with each weight line" if line else "no line prefetch"
    kinds = ((kquant_burst, "K-quants"), (wide32_burst, "32-wide types"))
    bursts = [f"{burst} B on for {kind}" for burst, kind in kinds if burst]
    if bursts:
        how += f", the super-block {' and '.join(bursts)}, whole, before each decode step"
    groups = f"groups per thread side by side: {kquant_streams} (K-quants), {wide32_streams} (32-wide types)"
    return f"{walk} ({how}; {groups}; {WALK_ENV_VAR}={'|'.join(DECODE_WALKS)} to choose)"


def amx_absence() -> str:
    """Why K-quant and Q8_0 prefill do not run on AMX tiles here (for a build whose instruction set has no "+amx")."""
    if "amx_int8" not in cpu_flags().split():
        return "not on this CPU (the vector kernels run prefill)"
    if os.environ.get("RUNLM_AMX", "").strip() == "0":
        return "on this CPU, off by RUNLM_AMX=0"
    if variant() != "amx":
        return f"on this CPU, not in the {variant()} build"
    return "on this CPU, but the kernel did not grant the process the tile state"


__all__ = [
    "ARM_VARIANTS", "BLOCK_LAYOUTS", "CFLAGS", "DECODE_WALKS", "ENV_VAR", "FLOAT_KERNEL_TYPES", "ISA_VARIANTS",
    "KERNEL_TYPES", "Q8_0_BYTES", "Q8_0_VALUES", "QK_K", "SOURCE", "SOURCES", "STANDALONE_FLAGS", "WALK_ENV_VAR",
    "X4", "X4_TYPES", "aarch64", "amx_absence", "best_variant", "build_key", "decode_walk_name",
    "decode_walk_summary", "source_key", "variant", "variant_cflags", "variants", "walks_weights",
]
