"""Packed int4 linears (runlm.pytorch.int4) against the float32 dequantized matmul x @ dequantize(...).T.

Tolerances (relative Frobenius error of the output):
* bfloat16 kernel (the fast one): < 1e-2. Sources: bf16 activations, scale/zero rounded to bf16, bf16 output;
  measured ~3e-3 on real tensors, about the same as a dense bf16 matmul of the exact weights.
* float32 kernel (scalar fallback, built with allow_slow_kernel=True): < 1e-5 (measured ~5e-7, i.e. only
  summation order): proves the packing and the scale/zero mapping are exact.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as ref_quants
from reference.quant_blocks import random_blocks, rel_err

from runlm.errors import InvalidInputError
from runlm.formats.gguf import GGUFFile
from runlm.pytorch import int4 as packed_mod
from runlm.pytorch.dequant import dequantize
from runlm.pytorch.int4 import (
    ConcatLinear,
    DenseLinear,
    Int4Linear,
    concat_linears,
    make_linear,
    pack_linear,
)

BF16_TOL = 1e-2
F32_TOL = 1e-5


def quantized(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return ref_quants.quantize(values, GGMLQuantizationType[type_name])


def check(module, type_name: str, data: np.ndarray, shape: tuple[int, int], tol: float, seed: int = 0) -> float:
    weight = dequantize(type_name, data, shape)
    x = torch.randn(3, shape[1], generator=torch.Generator().manual_seed(seed))
    out = module(x)
    assert out.dtype == torch.float32 and out.shape == (3, shape[0])
    err = rel_err(out, x @ weight.T)
    assert err < tol, f"{type_name} {shape}: relative error {err:.2e} >= {tol}"
    return err


# gguf cannot quantize Q4_K: it is covered by random bytes and real tensors.
@pytest.mark.parametrize(
    "type_name,source",
    [
        ("Q4_0", "random_bytes"),
        ("Q4_1", "random_bytes"),
        ("Q4_K", "random_bytes"),
        ("Q4_0", "quantized"),
        ("Q4_1", "quantized"),
    ],
)
def test_random_int4_blocks(type_name: str, source: str):
    shape = (96, 512)
    if source == "quantized":
        data = quantized(type_name, *shape, seed=1)
    else:
        data = random_blocks(type_name, *shape, seed=2)
    fast = pack_linear(type_name, data, shape, torch.bfloat16)
    assert isinstance(fast, Int4Linear) and (fast.in_features, fast.out_features) == (512, 96)
    check(fast, type_name, data, shape, BF16_TOL)
    exact = pack_linear(type_name, data, shape, torch.float32, allow_slow_kernel=True)
    check(exact, type_name, data, shape, F32_TOL)


def test_kernel_formula_and_layout_facts():
    """(q - 8) * scale + zero per 32-group, scales_and_zeros [K/32, N, 2], packed uint8 [N, K/2]."""
    gen = torch.Generator().manual_seed(0)
    n, k = 64, 128
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=gen) + 0.5
    offset = torch.randn(n, k // 32, generator=gen)
    module = Int4Linear.from_groups(q, scale, offset, torch.float32)
    assert module.packed.dtype == torch.uint8 and module.packed.shape == (n, k // 2)
    assert module.scales_and_zeros.shape == (k // 32, n, 2)
    zero = module.scales_and_zeros[..., 1].t().repeat_interleave(32, dim=1)
    weight = (q.float() - 8) * scale.repeat_interleave(32, dim=1) + zero
    torch.testing.assert_close(weight, q.float() * scale.repeat_interleave(32, dim=1) + offset.repeat_interleave(32, 1))
    x = torch.randn(5, k, generator=gen)
    assert rel_err(module(x), x @ weight.T) < F32_TOL


@pytest.mark.parametrize(
    "fixture,type_name", [("smollm2_gguf", "Q4_1"), ("gemma3_gguf", "Q4_K")], ids=["smollm2", "gemma3"]
)
def test_real_tensors(fixture: str, type_name: str, request: pytest.FixtureRequest):
    gguf = GGUFFile(request.getfixturevalue(fixture))
    by_shape: dict[tuple[int, ...], str] = {}  # one tensor of each distinct shape of this type
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        if raw.type_name == type_name:
            by_shape.setdefault(raw.shape, name)
    names = list(by_shape.values())
    assert names, f"no {type_name} tensor"
    errors = {}
    for name in names:
        raw = gguf.raw(name)
        module = pack_linear(raw.type_name, raw.data, raw.shape, torch.bfloat16)
        assert module is not None
        errors[name] = check(module, raw.type_name, raw.data, raw.shape, BF16_TOL)
    raw = gguf.raw(names[0])
    check(
        pack_linear(raw.type_name, raw.data, raw.shape, torch.float32, allow_slow_kernel=True),
        type_name,
        raw.data,
        raw.shape,
        F32_TOL,
    )
    print(f"\n{fixture} bf16 packed relative errors: " + ", ".join(f"{k}={v:.1e}" for k, v in errors.items()))


def test_types_without_a_fast_kernel_return_none(gemma3_gguf):
    gguf = GGUFFile(gemma3_gguf)
    seen = set()
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        if raw.type_name in ("Q8_0", "Q5_0", "Q6_K", "F32") and raw.type_name not in seen and len(raw.shape) == 2:
            assert pack_linear(raw.type_name, raw.data, raw.shape, torch.bfloat16) is None, raw.type_name
            seen.add(raw.type_name)
    assert {"Q8_0", "Q5_0", "Q6_K"} <= seen
    data = random_blocks("Q4_0", 64, 64, seed=3)
    # float32/float16 only have the slow scalar kernel: no packed module unless asked for explicitly
    assert pack_linear("Q4_0", data, (64, 64), torch.float32) is None
    assert pack_linear("Q4_0", data, (64, 64), torch.float16) is None
    # the kernel needs out_features % 16 == 0
    assert pack_linear("Q4_0", random_blocks("Q4_0", 40, 64, seed=3), (40, 64), torch.bfloat16) is None


def test_permuted_rows_pack_like_permuted_weights():
    data = random_blocks("Q4_K", 64, 256, seed=4)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0)).numpy()
    module = pack_linear("Q4_K", np.ascontiguousarray(data[perm]), (64, 256), torch.float32, allow_slow_kernel=True)
    weight = dequantize("Q4_K", data, (64, 256))[perm]
    x = torch.randn(2, 256)
    assert rel_err(module(x), x @ weight.T) < F32_TOL


def test_leading_dims_and_dtypes():
    data = random_blocks("Q4_1", 32, 64, seed=5)
    module = pack_linear("Q4_1", data, (32, 64), torch.bfloat16)
    weight = dequantize("Q4_1", data, (32, 64))
    x = torch.randn(2, 3, 64)
    out = module(x)
    assert out.shape == (2, 3, 32) and out.dtype == torch.float32
    assert rel_err(out, x @ weight.T) < BF16_TOL
    out16 = module(x.to(torch.bfloat16))
    assert out16.dtype == torch.bfloat16
    assert rel_err(out16, x @ weight.T) < BF16_TOL
    assert module(torch.randn(0, 64)).shape == (0, 32)
    assert module(x.transpose(0, 1)).shape == (3, 2, 32)  # non-contiguous input

    dense = DenseLinear(weight, dtype=torch.bfloat16)
    assert dense.weight.dtype == torch.bfloat16 and (dense.in_features, dense.out_features) == (64, 32)
    out = dense(x)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 32)
    assert rel_err(out, x @ weight.T) < BF16_TOL
    assert torch.equal(DenseLinear(weight)(x), torch.nn.functional.linear(x, weight))


def test_chunked_packing_equals_one_shot(monkeypatch: pytest.MonkeyPatch):
    data = random_blocks("Q4_0", 192, 64, seed=6)
    whole = pack_linear("Q4_0", data, (192, 64), torch.bfloat16)
    monkeypatch.setattr(packed_mod, "_PACK_ROWS", 64)
    chunked = pack_linear("Q4_0", data, (192, 64), torch.bfloat16)
    assert torch.equal(whole.packed, chunked.packed)


def test_concat_int4_stays_packed_and_matches_separate():
    shapes = [(128, 256), (64, 256), (64, 256)]  # e.g. fused q/k/v
    datas = [random_blocks("Q4_K", *s, seed=10 + i) for i, s in enumerate(shapes)]
    parts = [pack_linear("Q4_K", d, s, torch.bfloat16) for d, s in zip(datas, shapes, strict=True)]
    fused = concat_linears(parts)
    assert isinstance(fused, Int4Linear) and (fused.in_features, fused.out_features) == (256, 256)
    x = torch.randn(4, 256)
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=0, atol=0)


def test_concat_when_not_mergeable_and_dense():
    x = torch.randn(3, 64)
    odd = pack_linear("Q4_0", random_blocks("Q4_0", 48, 64, seed=20), (48, 64), torch.bfloat16)
    even = pack_linear("Q4_0", random_blocks("Q4_0", 64, 64, seed=21), (64, 64), torch.bfloat16)
    fused = concat_linears([odd, even])  # 48 rows is not a whole kernel row tile: runs the parts separately
    assert isinstance(fused, ConcatLinear) and fused.out_features == 112
    torch.testing.assert_close(fused(x), torch.cat([odd(x), even(x)], -1), rtol=0, atol=0)

    w1, w2 = torch.randn(16, 64), torch.randn(8, 64)
    dense = concat_linears([DenseLinear(w1), DenseLinear(w2)])
    assert isinstance(dense, DenseLinear) and dense.out_features == 24
    torch.testing.assert_close(dense(x), torch.cat([x @ w1.T, x @ w2.T], -1))

    mixed = concat_linears([DenseLinear(w1, torch.bfloat16), even])
    assert isinstance(mixed, ConcatLinear) and mixed.out_features == 80
    torch.testing.assert_close(mixed(x), torch.cat([DenseLinear(w1, torch.bfloat16)(x), even(x)], -1))

    with pytest.raises(InvalidInputError):
        concat_linears([DenseLinear(torch.randn(4, 8)), DenseLinear(torch.randn(4, 16))])
    with pytest.raises(InvalidInputError):
        concat_linears([])


def test_make_linear_picks_packed_or_dense():
    q4 = random_blocks("Q4_K", 32, 256, seed=30)
    assert isinstance(make_linear("Q4_K", q4, (32, 256), torch.bfloat16), Int4Linear)
    assert isinstance(make_linear("Q4_K", q4, (32, 256), torch.bfloat16, packed=False), DenseLinear)
    assert isinstance(make_linear("Q4_K", q4, (32, 256), torch.float32), DenseLinear)
    q8 = ref_quants.quantize(
        np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32), GGMLQuantizationType.Q8_0
    )
    dense = make_linear("Q8_0", q8, (32, 64), torch.bfloat16)
    assert isinstance(dense, DenseLinear) and dense.weight.dtype == torch.bfloat16
