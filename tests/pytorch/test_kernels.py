"""runlm's GGUF block kernels (runlm/native/csrc via runlm.pytorch.kernels) against float references.

Tolerances (relative Frobenius error of the output [M, N]):
* EXACT_TOL = 2e-6 against x_q @ dequantize(W).T in float64, where x_q is the activation quantized to 8 bits the
  way the kernel does it (emulated below with the same float32 operations). Measured <= 6e-7 on random and real
  weights, all types, M = 1, 3, 17 (float32 rounding of the block scale products and the accumulation only):
  proves the unpacking of every format, the integer dot products and the scale / min / offset algebra.
* Against the plain float reference x @ dequantize(W).T (llama.cpp has the same error; it comes from rounding
  the activation to 8 bits): TOL_32 = 1.5e-2 for the 32-wide types (one activation scale per 32 values;
  measured 4e-3..8.5e-3) and TOL_K = 3e-2 for the K-quants (one activation scale per 256 values; measured
  4e-3..1.3e-2, the top from random-byte weights with random mins; real Q4_K / Q6_K tensors measure <= 8e-3).
* runlm::gguf_dequantize equals runlm.pytorch.dequant.dequantize bit for bit.
* A float16 KV cache: values are stored as torch rounds them to float16, bit for bit, and attention over the cache
  is SDPA over its values widened to float32 (1e-5), in every build.
* A q8_0 KV cache: rows are stored as the gguf package quantizes them to Q8_0, byte for byte, and attention over the
  cache is bit for bit attention over a float32 cache of those blocks dequantized by the gguf package, in every build.

Run with -s to see the measured errors and the micro-benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as ref_quants
from reference.quant_blocks import F16_FIELDS, random_blocks, rel_err

from runlm.errors import InvalidInputError, ModelLoadError
from runlm.formats.gguf import GGUFFile
from runlm.native import build
from runlm.pytorch import kernels
from runlm.pytorch.dequant import dequantize
from runlm.pytorch.nn import FullKVCache
from runlm.system import cpu_flags

EXACT_TOL = 2e-6
TOL_32 = 1.5e-2
TOL_K = 3e-2
TYPES = list(kernels.KERNEL_TYPES)
GGUF_QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"}
ROWS_M = (1, 3, 17)


@pytest.fixture(scope="module", autouse=True)
def kernels_ready():
    if not kernels.available():
        pytest.skip(kernels.unavailable_reason() or "kernels unavailable")


def super_blocks(type_name: str) -> bool:
    """Whether the type's blocks are 256 values (the K-quants, IQ4_XS), met by 256-value activation blocks."""
    return build.BLOCK_LAYOUTS[type_name][0] == 256


def tol_for(type_name: str) -> float:
    return TOL_K if super_blocks(type_name) else TOL_32


def weight_data(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """gguf-quantized gaussian weights where the gguf package can quantize the type, random blocks otherwise."""
    if type_name in GGUF_QUANTIZABLE:
        values = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return ref_quants.quantize(values, GGMLQuantizationType[type_name])
    return random_blocks(type_name, rows, cols, seed)


def quantized_activation(x: torch.Tensor, type_name: str) -> torch.Tensor:
    """x (float32 [M, K]) rounded to 8 bits per block exactly like the kernel (float64 result)."""
    block = build.BLOCK_LAYOUTS[type_name][0]
    rows, cols = x.shape
    xb = x.float().reshape(rows, cols // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    scale = amax / 127.0
    if block == 32:  # the 32-wide blocks' scale is rounded to float16, as llama.cpp's Q8_0 activations carry it
        scale = scale.half().float()
    # (not `127.0 / amax`: torch computes scalar / tensor as reciprocal(tensor) * scalar, rounding twice)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv)  # round half to even, like nearbyint / _MM_FROUND_TO_NEAREST_INT
    return (codes.double() * scale.double()).reshape(rows, cols)


def check_against_references(module, type_name: str, weight: torch.Tensor, x: torch.Tensor) -> tuple[float, float]:
    """(error vs the quantized-activation reference, error vs the float reference); asserts both bounds."""
    out = module(x)
    assert out.dtype == torch.float32 and out.shape == (x.shape[0], weight.shape[0])
    exact = rel_err(out, quantized_activation(x, type_name) @ weight.double().T)
    approx = rel_err(out, x.double() @ weight.double().T)
    label = f"{type_name} {tuple(weight.shape)} M={x.shape[0]}"
    assert exact < EXACT_TOL, f"{label}: error {exact:.2e} vs the quantized-activation reference"
    assert approx < tol_for(type_name), f"{label}: error {approx:.2e} vs the float reference"
    return exact, approx


def kernel_module(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> kernels.GGUFLinear:
    module = kernels.gguf_linear_module(type_name, data, shape)
    assert isinstance(module, kernels.GGUFLinear)
    module.dense_min_rows = 1 << 30  # always the 8-bit kernels here; the dense path has its own test
    return module


def check_half_cache() -> None:
    """decode_attention over a float16 cache (this build's F16C conversions, or the portable ones): each new key /
    value is stored as torch rounds it (to nearest even, overflow to inf, subnormals kept), and the output is SDPA
    over the cache's values widened to float32."""
    heads, kv_heads, head_dim, positions = 4, 2, 16, 12
    no_rope = torch.ones(head_dim), torch.zeros(head_dim)

    def half_caches() -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = torch.zeros(1, kv_heads, positions, head_dim, dtype=torch.float16)
        return k_cache, torch.zeros_like(k_cache)

    def step(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int) -> torch.Tensor:
        out = torch.ops.runlm.decode_attention(qkv, *no_rope, k_cache, v_cache, pos, heads, kv_heads, 0.25)
        keys = qkv[heads : heads + kv_heads]
        roped = keys * no_rope[0] + keys.roll(head_dim // 2, -1) * no_rope[1]  # as the kernel ropes: -0.0 -> 0.0
        stored = torch.stack([roped, qkv[heads + kv_heads :]]).half().view(torch.int16)
        assert torch.equal(k_cache[0, :, pos].view(torch.int16), stored[0]), pos
        assert torch.equal(v_cache[0, :, pos].view(torch.int16), stored[1]), pos
        return out

    ulp = 2.0**-11  # half an f16 ulp at 1: ties and near-ties round to even
    edge_cases = torch.tensor([65504.0, 65519.0, 65520.0, -7e4, 6e-8, 3e-8, 2.9e-8, 1e-5, -0.0, 1 + ulp,
                               1 + 3 * ulp, 1 + ulp * 1.001, 2049.0, 2051.0, 1e-3, -1e-3])
    step(edge_cases.repeat(heads + 2 * kv_heads, 1), *half_caches(), 0)  # caches of their own: they hold infinities
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache = half_caches()
    for pos in range(positions):
        qkv = torch.randn(heads + 2 * kv_heads, head_dim, generator=gen) * 10 ** (pos % 4 - 2)
        out = step(qkv, k_cache, v_cache, pos)
        keys, values = k_cache[:, :, : pos + 1].float(), v_cache[:, :, : pos + 1].float()
        want = F.scaled_dot_product_attention(qkv[None, :heads, None], keys, values, scale=0.25, enable_gqa=True)
        assert (out - want.reshape(-1)).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item()), pos


def check_q8_0_cache() -> None:
    """decode_attention over a q8_0 cache (this build's loads, or the portable ones): each new key / value row is
    stored as the gguf package quantizes it to Q8_0, byte for byte, and the output is bit for bit what a float32
    cache holding those blocks dequantized by the gguf package gives (the values attention reads are the blocks')."""
    heads, kv_heads, head_dim, positions = 4, 2, 64, 13
    no_rope = torch.ones(head_dim), torch.zeros(head_dim)
    cpu, q8_0 = torch.device("cpu"), GGMLQuantizationType.Q8_0
    quantized = FullKVCache(kv_heads, head_dim, torch.uint8, cpu, capacity=4)  # grows twice on the way
    widened = FullKVCache(kv_heads, head_dim, torch.float32, cpu, capacity=positions)
    gen = torch.Generator().manual_seed(12)
    written = []
    for pos in range(positions):
        qkv = torch.randn(heads + 2 * kv_heads, head_dim, generator=gen) * 10 ** (pos % 4 - 2)
        if pos == 5:
            qkv[heads] = 0.0  # a key of zeros: a block scale of 0
        out = quantized.decode_attention(qkv, *no_rope, pos, heads, kv_heads, 0.25)
        stored = torch.stack([quantized.k[0, :, pos], quantized.v[0, :, pos]]).numpy()
        new_rows = qkv[heads:].reshape(2, kv_heads, head_dim).numpy()  # keys (RoPE is the identity here), values
        assert np.array_equal(stored, ref_quants.quantize(new_rows, q8_0)), pos
        written.append(torch.from_numpy(stored))
        values = torch.from_numpy(ref_quants.dequantize(stored, q8_0)).reshape(-1, head_dim)
        want = widened.decode_attention(torch.cat([qkv[:heads], values]), *no_rope, pos, heads, kv_heads, 0.25)
        assert torch.equal(out, want), pos
    kept = torch.stack([quantized.k[0, :, :positions], quantized.v[0, :, :positions]])  # [2, kv_heads, pos, bytes]
    assert torch.equal(kept, torch.stack(written, dim=2))  # every row kept through the cache's two growths


# ---------------------------------------------------------------------------------------------------------------
# Correctness


def test_half_cache_rounds_as_torch_and_attends_over_widened_values():
    check_half_cache()


def test_q8_0_cache_stores_gguf_blocks_and_attends_over_their_values():
    check_q8_0_cache()
    short = FullKVCache(2, 16, torch.uint8, torch.device("cpu"), capacity=2)  # 16-wide heads: half a block
    with pytest.raises(RuntimeError, match="q8_0 cache needs a head dim that is a multiple of 32, got 16"):
        short.decode_attention(torch.randn(8, 16), torch.ones(16), torch.zeros(16), 0, 4, 2, 0.25)


def test_build_info():
    info = kernels.build_info()
    assert info["ok"] is True and info["reason"] is None
    simd_isas = ("avx512-vnni+amx", "avx512-vnni", "avx-vnni", "avx2")
    assert kernels.isa() == info["isa"] and info["isa"] in (simd_isas if info["simd"] else ("scalar",))
    print(f"\nkernels: isa={info['isa']} first load {info['build_s']:.1f}s name={info['name']}")


@pytest.mark.parametrize("type_name", TYPES)
def test_random_weights(type_name: str):
    shape = (80, 512)  # 80 rows: whole groups of the interleaved layout (4 or 16 rows)
    data = weight_data(type_name, *shape, seed=1)
    module = kernel_module(type_name, data, shape)
    assert (module.in_features, module.out_features) == (512, 80)
    assert module.x4 == (kernels.simd() and kernels.group_rows(type_name) > 0)
    weight = dequantize(type_name, data, shape)
    gen = torch.Generator().manual_seed(0)
    errors = []
    for rows in ROWS_M:
        x = torch.randn(rows, shape[1], generator=gen)
        errors.append(check_against_references(module, type_name, weight, x))
    print(f"\n{type_name}: " + ", ".join(f"M={m} exact {e:.1e} float {a:.1e}" for m, (e, a) in zip(ROWS_M, errors)))


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_real_tensors(fixture: str, request: pytest.FixtureRequest):
    gguf = GGUFFile(request.getfixturevalue(fixture))
    picked: dict[tuple[str, tuple[int, ...]], str] = {}  # one tensor of each distinct (type, shape)
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        if raw.type_name in kernels.KERNEL_TYPES and len(raw.shape) == 2:
            picked.setdefault((raw.type_name, raw.shape), name)
    types = {type_name for type_name, _ in picked}
    expected = {"smollm2_gguf": {"Q4_1", "Q8_0"}, "gemma3_gguf": {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}}[fixture]
    assert expected <= types
    gen = torch.Generator().manual_seed(0)
    lines = []
    for (type_name, shape), name in sorted(picked.items()):
        raw = gguf.raw(name)
        rows = min(shape[0], 4096)  # the tied heads (49152 / 262144 rows): a slice of rows
        data = np.asarray(raw.data)[:rows]
        module = kernel_module(type_name, data, (rows, shape[1]))
        weight = dequantize(type_name, data, (rows, shape[1]))
        for m in ROWS_M:
            x = torch.randn(m, shape[1], generator=gen)
            exact, approx = check_against_references(module, type_name, weight, x)
            lines.append(f"{name} {type_name} {shape} M={m}: exact {exact:.1e} float {approx:.1e}")
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize("type_name", kernels.X4_TYPES)
def test_x4_layout_matches_plain_rows(type_name: str):
    # two K-quant super-blocks per row; whole groups of 4 or 16 rows, and five of 16: a decode GEMV walks groups
    # 0 and 2, 1 and 3 side by side, then 4 alone (kernels.cpp, stream_rows)
    shape = (80, 512)
    data = weight_data(type_name, *shape, seed=7)
    plain = kernels.gguf_linear_module(type_name, data, shape, interleave=False)
    plain.dense_min_rows = 1 << 30
    x4 = plain.interleaved()
    if not kernels.simd() or not kernels.group_rows(type_name):  # (IQ4_XS has groups in AVX-512 builds only)
        assert x4 is plain
        return
    x4.dense_min_rows = 1 << 30
    assert x4.x4 and not plain.x4 and "layout=x4" in repr(x4)
    assert not torch.equal(x4.blocks, plain.blocks) and torch.equal(x4.plain_blocks(), plain.blocks)
    ref = dequantize(type_name, data, shape)
    assert torch.equal(x4.dequantized(), ref) and torch.equal(x4.dequantized(5, 9), ref[5:9])
    picked = torch.tensor([[47, 0], [17, 17]])  # a tied head's embedding lookup: rows straight from the groups
    assert torch.equal(x4.gathered(picked), ref[picked.reshape(-1)])
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, shape[1], generator=gen)
    single = torch.cat([x4(x[i : i + 1]) for i in range(9)])  # each row alone: the decode GEMV
    for m in (1, 2, 3, 5, 9):  # every tile shape of the x4 kernel (1-4 activation rows at a time; Q5_K: 8 at M=9)
        out = x4(x[:m])
        # a row's result does not depend on the rows beside it (route invariance), bit for bit
        assert torch.equal(out, single[:m]), f"{type_name}: M={m} differs from the rows computed alone"
        if super_blocks(type_name):  # the same integer sums per super-block and float steps as the row layout
            assert torch.equal(out, plain(x[:m])), f"{type_name}: M={m} x4 differs from the row layout"
        else:  # the same integers summed in another float order: equal to float rounding
            assert rel_err(out, plain(x[:m])) < EXACT_TOL
        check_against_references(x4, type_name, ref, x[:m])
    # x4 parts concatenate as x4; a plain part makes the whole plain; both compute the same
    both = kernels.GGUFLinear.cat([x4, x4])
    mixed = kernels.GGUFLinear.cat([x4, plain])
    assert both.x4 and not mixed.x4 and torch.equal(both.plain_blocks(), mixed.blocks)
    odd = kernels.gguf_linear_module(type_name, data[:6], (6, shape[1]))
    assert not odd.x4  # 6 rows: not whole groups
    with pytest.raises(InvalidInputError):
        kernels.GGUFLinear(type_name, odd.blocks, shape[1], 6, x4=True)


@pytest.mark.parametrize("type_name", kernels.X4_TYPES)
def test_integer_sums_hold_at_the_largest_codes(type_name: str):
    """The AVX2 kernels add byte products up in 16-bit lanes as far as the codes' range allows: with every code at
    its largest (every byte 0xFF but the float16 scales; Q8_0's codes 127) and activations at +-127, no sum
    saturates: each layout gives the quantized-activation reference's result, and the interleaved one the row
    layout's bit for bit."""
    shape = (16, 512)
    data = random_blocks(type_name, *shape, seed=5).reshape(-1, build.BLOCK_LAYOUTS[type_name][1])
    scales = {offset: data[:, offset : offset + 2].copy() for offset in F16_FIELDS[type_name]}
    data[:] = 0x7F if type_name == "Q8_0" else 0xFF
    for offset, kept in scales.items():
        data[:, offset : offset + 2] = kept
    data = data.reshape(shape[0], -1)
    plain = kernels.gguf_linear_module(type_name, data, shape, interleave=False)
    plain.dense_min_rows = 1 << 30
    x4 = plain.interleaved()
    x4.dense_min_rows = 1 << 30
    weight = dequantize(type_name, data, shape)
    signs = torch.ones(shape[1])
    signs[1::3] = -1
    x = torch.stack([torch.ones(shape[1]), -torch.ones(shape[1]), signs, -signs, torch.ones(shape[1])])
    for m in (1, 4, 5):
        for module in (plain, x4):
            check_against_references(module, type_name, weight, x[:m])
        if super_blocks(type_name):
            assert torch.equal(x4(x[:m]), plain(x[:m])), f"{type_name}: M={m} x4 differs from the row layout"


@pytest.fixture
def restore_decode_walk():
    yield
    torch.ops.runlm.gguf_set_decode_walk(*kernels.DECODE_WALKS[kernels.build_info()["walk"]])


@pytest.mark.parametrize("type_name", kernels.X4_TYPES)
def test_decode_walks_give_the_same_bits(type_name: str, restore_decode_walk):
    """How a decode GEMV prefetches and walks its weights (kernels.DECODE_WALKS) moves no result bit: each walk, and
    prefetches reaching past the weight's end (8 KiB on), give the same outputs for 1-4 activation rows (the decode
    walk, over five 16-row groups of three super-blocks, or twenty 4-row groups: with two streams pairs, and with
    16 rows one alone) and for 8 (the tiles, which keep the line prefetch)."""
    shape = (80, 768)
    module = kernel_module(type_name, weight_data(type_name, *shape, seed=11), shape)
    if kernels.group_rows(type_name) not in (4, 16):
        pytest.skip("no interleaved groups in this build")
    assert module.x4
    x = torch.randn(8, shape[1], generator=torch.Generator().manual_seed(11))
    outputs = {}
    for name, walk in {**kernels.DECODE_WALKS, "far": (8192, 8192, 8192, 2, 1)}.items():
        torch.ops.runlm.gguf_set_decode_walk(*walk)
        assert list(torch.ops.runlm.gguf_decode_walk()) == list(walk)
        outputs[name] = [module(x[:m]) for m in (1, 2, 3, 4, 8)]
    first = outputs.pop("line")
    for name, outs in outputs.items():
        assert all(torch.equal(a, b) for a, b in zip(first, outs)), f"{type_name}: the {name} walk changed results"


def test_decode_walk_follows_the_cpu_or_the_environment(monkeypatch: pytest.MonkeyPatch, caplog, restore_decode_walk):
    assert kernels.build_info()["walk"] in kernels.DECODE_WALKS
    assert kernels.decode_walk() == (kernels.build_info()["walk"] if build.walks_weights(kernels.isa()) else None)
    monkeypatch.delenv(kernels.WALK_ENV_VAR, raising=False)
    monkeypatch.setattr(build, "cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(build, "cpu_family", lambda: 26)
    assert build.decode_walk_name("avx512-vnni") == "burst"  # the 16-row kernels on AMD Zen 5
    monkeypatch.setattr(build, "cpu_family", lambda: 25)
    assert build.decode_walk_name("avx512-vnni") == "burst-32"  # on Zen 4 the K-quants go without the burst
    assert build.decode_walk_name("avx2") == "line"  # the 4-row groups, whatever the vendor
    monkeypatch.setattr(build, "cpu_vendor", lambda: "GenuineIntel")
    assert build.decode_walk_name("avx512-vnni") == build.decode_walk_name("avx-vnni") == "line"
    monkeypatch.setenv(kernels.WALK_ENV_VAR, " Burst ")
    assert build.decode_walk_name("avx2") == "burst"
    monkeypatch.setenv(kernels.WALK_ENV_VAR, "fastest")
    assert build.decode_walk_name("avx2") == "line"
    assert "RUNLM_DECODE_WALK=fastest is not a decode walk" in caplog.text
    set_walk = torch.ops.runlm.gguf_set_decode_walk
    for bad, message in (((2048, 0, 0, 3, 2), "streams must be 1 or 2"), ((2048, 0, 0, 2, 0), "streams must be 1 or 2"),
                         ((100, 0, 0, 1, 1), "multiple of 64"), ((0, -1, 0, 1, 1), "burst distance must be"),
                         ((0, 0, 1 << 17, 1, 1), "burst distance must be")):
        with pytest.raises(RuntimeError, match=message):
            set_walk(*bad)


@pytest.mark.parametrize("type_name", kernels.X4_TYPES)
def test_x4_load_regroups_parts_chunk_by_chunk_into_the_module(type_name: str, monkeypatch: pytest.MonkeyPatch):
    """from_parts regroups through a small scratch straight into the module's buffer: the same bytes as
    regrouping the whole stacked weight at once, whatever the chunk size."""
    if not kernels.simd() or not kernels.group_rows(type_name):
        pytest.skip(f"no x4 layout for {type_name} in this build")
    shape = (48, 512)
    data = weight_data(type_name, *shape, seed=11)
    whole = kernels.gguf_linear_module(type_name, data, shape, interleave=False)
    want = torch.ops.runlm.gguf_relayout(whole.blocks, whole.type_id, *shape)
    row_bytes = whole.blocks.shape[1]
    for chunk_rows in (4, 8, 40):
        monkeypatch.setattr(kernels, "_LOAD_CHUNK_BYTES", chunk_rows * row_bytes)
        monkeypatch.setattr(kernels._load_scratch, "buffer", None, raising=False)
        parts = [kernels._OwnedRows(type_name, data[:32], (32, 512)),
                 kernels._OwnedRows(type_name, data[32:], (16, 512))]
        module = kernels.GGUFLinear.from_parts(type_name, parts, interleave=True)
        assert module.x4 and torch.equal(module.blocks, want), f"{chunk_rows}-row chunks"
    with pytest.raises(RuntimeError, match="as many as the weight's"):
        torch.ops.runlm.gguf_relayout_into(whole.blocks, torch.empty(8, dtype=torch.uint8), whole.type_id, *shape)


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_op_matches_reference(type_name: str):
    shape = (24, 512)
    data = weight_data(type_name, *shape, seed=2)
    module = kernels.GGUFLinear.from_raw(type_name, data, shape)
    ref = dequantize(type_name, data, shape)
    assert torch.equal(module.dequantized(), ref)
    assert torch.equal(module.dequantized(5, 9), ref[5:9])
    assert torch.equal(kernels.gguf_dequantize(module.blocks[[3, 0, 3]], type_name, (3, 512)), ref[[3, 0, 3]])
    assert torch.equal(module.gathered(torch.tensor([3, 0, 23, 3])), ref[[3, 0, 23, 3]])
    assert module.gathered(torch.tensor([], dtype=torch.long)).shape == (0, 512)
    with pytest.raises(RuntimeError, match="out of range"):
        module.gathered(torch.tensor([24]))


def test_dense_path_for_many_rows():
    shape = (96, 256)
    data = weight_data("Q4_K", *shape, seed=3)
    module = kernels.GGUFLinear.from_raw("Q4_K", data, shape)
    weight = dequantize("Q4_K", data, shape)
    x = torch.randn(module.dense_min_rows, 256)
    assert rel_err(module(x), F.linear(x, weight)) < 1e-6  # dequantize + float32 GEMM
    small = x[: module.dense_min_rows - 1]
    assert rel_err(module(small), F.linear(small, weight)) < TOL_K  # 8-bit kernels


def test_sixteen_row_groups_stay_on_the_kernels_for_many_rows():
    """16-row groups (AVX-512 builds) never take the dense path: a long prompt's rows come out as each row alone."""
    shape = (64, 256)
    module = kernels.gguf_linear_module("Q4_K", weight_data("Q4_K", *shape, seed=3), shape)
    if module.group != 16:
        pytest.skip("this build has no 16-row groups (no AVX-512 VNNI)")
    assert module.dense_min_rows == kernels.NEVER_DENSE
    x = torch.randn(2 * kernels.DENSE_MIN_ROWS["Q4_K"], 256)
    assert torch.equal(module(x), torch.cat([module(row[None]) for row in x]))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q8_0"])
@pytest.mark.parametrize(("shape", "rows"), [((48, 2048), 83), ((32, 8192), 300)])
def test_amx_tiles_give_the_dot_kernels_results(type_name: str, shape: tuple[int, int], rows: int):
    """Where the CPU has AMX, a call of 16 rows or more runs Q4_K / Q5_K / Q6_K (scales split into factors folded into
    the codes) and Q8_0 (each block's halves apart) on the tiles: the results are those of each row alone through the
    vector kernel, bit for bit, for whole and partial 16-row tiles and several blocks. 83 rows at K = 2048 go in one
    pass over the weights; 300 rows at K = 8192 in several, since a pass keeps its activation blocks within 1 MiB
    (K-quants 112 + 112 + 76, Q8_0 80 + 80 + 80 + 60)."""
    module = kernels.gguf_linear_module(type_name, weight_data(type_name, *shape, seed=11), shape)
    if module.group != 16:
        pytest.skip("this build has no 16-row groups (no AVX-512 VNNI)")
    if "amx_int8" in cpu_flags().split() and os.environ.get("RUNLM_AMX") != "0":
        assert kernels.isa() == "avx512-vnni+amx"
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(5)) * 3
    assert torch.equal(module(x), torch.cat([module(row[None]) for row in x]))


def test_dense_path_chunks_large_weights(monkeypatch: pytest.MonkeyPatch):
    shape = (100, 64)
    data = weight_data("Q8_0", *shape, seed=4)
    module = kernels.GGUFLinear.from_raw("Q8_0", data, shape)
    monkeypatch.setattr(kernels, "_DENSE_CHUNK_ELEMENTS", 64 * 30)  # 30 rows at a time: 4 chunks
    module.dense_min_rows = 1
    x = torch.randn(2, 64)
    assert rel_err(module(x), F.linear(x, dequantize("Q8_0", data, shape))) < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Module interface


def test_module_interface_and_dtypes():
    shape = (40, 64)
    data = weight_data("Q5_0", *shape, seed=5)
    module = kernel_module("Q5_0", data, shape)
    weight = dequantize("Q5_0", data, shape)
    assert "type=Q5_0" in repr(module) and module.blocks.dtype == torch.uint8 and module.blocks.shape == (40, 44)
    x = torch.randn(2, 3, 64)
    out = module(x)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float32
    assert rel_err(out, x @ weight.T) < TOL_32
    out16 = module(x.to(torch.bfloat16))
    assert out16.dtype == torch.bfloat16 and rel_err(out16, x @ weight.T) < TOL_32
    assert module(torch.randn(0, 64)).shape == (0, 40)
    xt = torch.randn(3, 2, 64).transpose(0, 1)  # non-contiguous
    assert torch.allclose(module(xt), module(xt.contiguous()))
    # rows do not depend on the batch they come in (up to float summation order: decode groups 4 weight rows)
    torch.testing.assert_close(module(x.reshape(6, 64))[4], module(x.reshape(6, 64)[4:5])[0], rtol=1e-5, atol=1e-6)


def test_bytes_are_copied_out_of_the_source(smollm2_gguf):
    raw = GGUFFile(smollm2_gguf).raw("blk.0.attn_k.weight")
    module = kernels.gguf_linear_module(raw.type_name, raw.data, raw.shape)
    assert module is not None and module.blocks.is_contiguous()
    assert module.blocks.data_ptr() != raw.data.ctypes.data
    assert np.array_equal(module.plain_blocks().numpy(), np.asarray(raw.data))
    source = torch.from_numpy(np.array(raw.data))
    module2 = kernels.gguf_linear_module(raw.type_name, source, raw.shape)
    source.zero_()
    assert torch.equal(module2.blocks, module.blocks)


def test_no_module_for_unsupported_inputs():
    assert kernels.gguf_linear_module("F32", np.zeros((4, 32), np.float32), (4, 32)) is None
    assert kernels.gguf_linear_module("BF16", np.zeros((4, 64), np.uint8), (4, 32)) is None
    assert kernels.gguf_linear_module("Q8_0", np.zeros(34, np.uint8), (32,)) is None
    assert kernels.gguf_linear_module("Q4_K", np.zeros((4, 144), np.uint8), (4, 128)) is None  # 128 % 256
    with pytest.raises(ModelLoadError):
        kernels.gguf_linear_module("Q8_0", np.zeros((4, 30), np.uint8), (4, 32))
    with pytest.raises(InvalidInputError):
        kernels.GGUFLinear("Q8_0", torch.zeros(4 * 34, dtype=torch.uint8), 32, 5)
    with pytest.raises(InvalidInputError):
        kernels.GGUFLinear("F16", torch.zeros(64, dtype=torch.uint8), 32, 1)


def test_op_rejects_bad_arguments():
    w = torch.zeros(2, 34, dtype=torch.uint8)
    op = torch.ops.runlm.gguf_linear
    with pytest.raises(RuntimeError, match="float32"):
        op(torch.zeros(1, 32, dtype=torch.float64), w, 8, 2, 32)
    with pytest.raises(RuntimeError, match="expected"):
        op(torch.zeros(1, 32), w, 8, 3, 32)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        op(torch.zeros(1, 32), w, 99, 2, 32)
    with pytest.raises(RuntimeError, match="block size"):
        op(torch.zeros(1, 16), w, 8, 2, 16)


def test_concat_along_output_dim():
    shapes = [(64, 256), (32, 256), (32, 256)]  # e.g. fused q/k/v
    datas = [weight_data("Q6_K", *s, seed=10 + i) for i, s in enumerate(shapes)]
    parts = [kernel_module("Q6_K", d, s) for d, s in zip(datas, shapes, strict=True)]
    fused = kernels.concat_gguf_linears(parts)
    assert isinstance(fused, kernels.GGUFLinear) and (fused.in_features, fused.out_features) == (256, 128)
    fused.dense_min_rows = 1 << 30
    for rows in (1, 5):
        x = torch.randn(rows, 256)
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-6)
    other = kernel_module("Q8_0", weight_data("Q8_0", 32, 256, seed=1), (32, 256))
    assert kernels.concat_gguf_linears([parts[0], other]) is None
    assert kernels.concat_gguf_linears([parts[0], torch.nn.Linear(256, 4)]) is None
    with pytest.raises(InvalidInputError):
        kernels.GGUFLinear.cat([parts[0], other])


def test_torch_compile_treats_op_as_opaque():
    shape = (48, 64)
    module = kernel_module("Q4_1", weight_data("Q4_1", *shape, seed=6), shape)
    x = torch.randn(3, 64)
    torch.library.opcheck(
        torch.ops.runlm.gguf_linear.default,
        (x, module.blocks, module.type_id, 48, 64),
        test_utils=("test_schema", "test_faketensor"),
    )
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), module(x))


# ---------------------------------------------------------------------------------------------------------------
# Build variants and fallback (each in a fresh process: one kernel build per process)

_VARIANT_SCRIPT = """
import sys
import torch
from runlm.pytorch import kernels
from runlm.pytorch.dequant import dequantize
import test_kernels as t
isa, expected = sys.argv[1], torch.load(sys.argv[2])
assert kernels.available(), kernels.unavailable_reason()
assert kernels.isa() == isa and kernels.build_info()["simd"] is (isa != "scalar"), kernels.build_info()
for type_name in kernels.KERNEL_TYPES:
    shape, x = t.variant_case(type_name)
    data = t.weight_data(type_name, *shape, seed=7)
    module = t.kernel_module(type_name, data, shape)
    weight = dequantize(type_name, data, shape)
    if type_name in expected:  # the K-quants: one integer sum and float sequence per super-block in every build
        assert torch.equal(module(x), expected[type_name]), type_name
    single = torch.cat([module(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in t.ROWS_M:
        assert torch.equal(module.dequantized(), weight)
        t.check_against_references(module, type_name, weight, x[:rows])
        assert torch.equal(module(x[:rows]), single[:rows]), (type_name, rows)  # rows alike for any row count
    if kernels.group_rows(type_name) and not module.x4:  # the x4 kernels' portable path, through the op
        x4 = torch.ops.runlm.gguf_relayout(module.blocks, module.type_id, *shape)
        out = torch.ops.runlm.gguf_linear(x[:5], x4, module.type_id + kernels.X4, *shape)
        if type_name in expected:  # K-quants: the row layout's integer sums and float steps
            assert torch.equal(out, module(x[:5])), type_name
        assert t.rel_err(out, module(x[:5])) < t.EXACT_TOL, type_name
for type_name in t.WIDE32_TYPES:  # this build's 4-row groups (Q8_0: its rows read 4 at a time as groups, unless it
    # regroups them): the same integers, in the same float chains as 16 rows
    if type_name + " x4" in expected:
        shape, x = t.GROUPS_CASE, t.variant_case(type_name)[1]
        module = t.kernel_module(type_name, t.weight_data(type_name, *shape, seed=7), shape)
        assert module.x4 == (type_name != "Q8_0" or kernels.group_rows(type_name) > 0), type_name
        assert torch.equal(module(x), expected[type_name + " x4"]), type_name
for type_name in t.TABLE_TYPES:  # read 4 rows at a time in every vector build: the same integers and float chains
    if type_name + " rows" in expected:
        shape, x = t.GROUPS_CASE, t.variant_case(type_name)[1]
        module = t.kernel_module(type_name, t.weight_data(type_name, *shape, seed=7), shape)
        assert torch.equal(module(x), expected[type_name + " rows"]), type_name
t.check_half_cache()
t.check_q8_0_cache()
print("variant ok")
"""


def _run(code: str, env_value: str, args: Sequence[str] = (), **extra_env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **{kernels.ENV_VAR: env_value}, **extra_env)
    here = os.path.dirname(__file__)  # this module, and tests/ for the shared reference helpers
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(here), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


GROUPS_CASE = (32, 512)  # whole groups of 16 rows and of 4
WIDE32_TYPES = tuple(name for name in kernels.X4_TYPES if build.BLOCK_LAYOUTS[name][0] == 32)  # interleaved, 32-wide
TABLE_TYPES = ("MXFP4", "IQ4_NL")  # codes through a table of levels, read from their rows 4 at a time


def variant_case(type_name: str) -> tuple[tuple[int, int], torch.Tensor]:
    """The weight shape and activation rows the build-variant check runs for a type."""
    shape = (12, 512)
    return shape, torch.randn(max(ROWS_M), shape[1], generator=torch.Generator().manual_seed(len(type_name) + 5))


@pytest.mark.parametrize(("variant", "isa"), [("scalar", "scalar"), ("avx2", "avx2"), ("avxvnni", "avx-vnni")])
def test_other_builds_match(variant: str, isa: str, tmp_path):
    """The portable path (-DRUNLM_SCALAR, what a compiler without AVX2 builds), the AVX2 path without AVX-512 (what
    an AVX2-only CPU runs) and that path with AVX-VNNI's dot products give the same results: exact against the
    quantized-activation reference, x4 rows alike for any row count, the x4 layout's portable kernel equal to the
    row layout's, and the K-quants and the table types (MXFP4, IQ4_NL) bit for bit equal to this build's; a float16
    KV cache rounds and attends as torch does."""
    if variant != "scalar" and variant not in build.variants():
        pytest.skip(f"no {variant} build on this architecture")
    if not build.ISA_VARIANTS.get(variant, ([], frozenset()))[1] <= set(cpu_flags().split()):
        pytest.skip(f"this CPU cannot run the {variant} build")
    expected = {}
    for type_name in (name for name in TYPES if super_blocks(name)):
        shape, x = variant_case(type_name)
        expected[type_name] = kernel_module(type_name, weight_data(type_name, *shape, seed=7), shape)(x)
    for type_name in WIDE32_TYPES if variant != "scalar" else ():  # 16-row groups on AVX-512 builds, 4 on AVX2: alike
        module = kernel_module(type_name, weight_data(type_name, *GROUPS_CASE, seed=7), GROUPS_CASE)
        assert module.x4
        expected[type_name + " x4"] = module(variant_case(type_name)[1])
    for type_name in TABLE_TYPES if variant != "scalar" else ():  # lifted levels (avx2) or VNNI's signed ones: alike
        module = kernel_module(type_name, weight_data(type_name, *GROUPS_CASE, seed=7), GROUPS_CASE)
        expected[type_name + " rows"] = module(variant_case(type_name)[1])
    torch.save(expected, tmp_path / "expected.pt")
    result = _run(_VARIANT_SCRIPT, variant, args=[isa, str(tmp_path / "expected.pt")])
    assert result.returncode == 0 and "variant ok" in result.stdout, result.stderr[-3000:]


def test_disabled_kernels_fall_back():
    code = """
import numpy as np, torch
from runlm.pytorch import kernels
from runlm.pytorch.dequant import dequantize
assert not kernels.available()
assert "disabled" in kernels.unavailable_reason()
data = np.random.default_rng(0).integers(0, 256, (8, 34), dtype=np.uint8)
data[:, :2] = np.full((8, 1), 0.01, np.float16).view(np.uint8)
assert kernels.gguf_linear_module("Q8_0", data, (8, 32)) is None
module = kernels.GGUFLinear.from_raw("Q8_0", data, (8, 32))
x = torch.randn(2, 32)
assert torch.allclose(module(x), x @ dequantize("Q8_0", data, (8, 32)).T)
print("fallback ok")
"""
    result = _run(code, "0")
    assert result.returncode == 0 and "fallback ok" in result.stdout, result.stderr[-3000:]


def test_failed_build_is_reported_not_raised(tmp_path):
    code = """
from runlm.pytorch import kernels
assert not kernels.available()
assert "Error building extension" in kernels.unavailable_reason(), kernels.unavailable_reason()
assert kernels.gguf_linear_module("Q8_0", bytes(34), (1, 32)) is None
print("reported ok")
"""
    result = _run(code, "", TORCH_EXTENSIONS_DIR=str(tmp_path), CXX="/nonexistent/c++")
    assert result.returncode == 0 and "reported ok" in result.stdout, result.stderr[-3000:]


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's build lock is a file a killed build leaves behind; the next load clears it instead of waiting forever
    (run where the extension is built already, so it only loads)."""
    code = """
import fcntl
from runlm.pytorch import kernels
directory = kernels._build_directory(kernels._extension_name())
with open(directory / "runlm-build.lock", "w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    (directory / "lock").touch()
assert kernels.available(), kernels.unavailable_reason()
assert not (directory / "lock").exists()
print("loaded")
"""
    result = _run(code, "")
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr[-3000:]
