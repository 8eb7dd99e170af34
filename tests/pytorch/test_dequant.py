"""runlm.pytorch.dequant.dequantize against the gguf package's reference dequantizer (gguf.quants.dequantize)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as ref_quants
from reference import quant_blocks

from runlm.errors import ModelLoadError
from runlm.formats.gguf import GGUFFile
from runlm.native.build import BLOCK_LAYOUTS
from runlm.pytorch.dequant import SUPPORTED_TYPES, dequantize

ALL_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
             "IQ4_NL", "IQ4_XS", "MXFP4"]
QUANT_TYPES = [t for t in ALL_TYPES if BLOCK_LAYOUTS[t][0] > 1]
# Types the gguf package can quantize (the rest are dequantize-only there).
REF_QUANTIZABLE = ["BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]


def reference(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    return np.asarray(ref_quants.dequantize(data, GGMLQuantizationType[type_name]), dtype=np.float32).reshape(shape)


def assert_matches(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    # ggml's operation order is reproduced, so this is normally bit-exact; allow 1e-6 relative.
    np.testing.assert_allclose(ours.numpy(), ref, rtol=1e-6, atol=0)


def random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    return quant_blocks.random_blocks(type_name, rows, cols, seed, signed_scales=True)


def test_supported_types_cover_the_brief():
    assert set(ALL_TYPES) == set(SUPPORTED_TYPES)


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_random_blocks_match_reference(type_name: str):
    rows, cols = 6, 512
    data = random_blocks(type_name, rows, cols, seed=ALL_TYPES.index(type_name))
    ref = reference(type_name, data, (rows, cols))
    assert np.isfinite(ref).all()
    assert_matches(dequantize(type_name, data, (rows, cols)), ref)
    # flat bytes and a torch uint8 tensor work too
    assert_matches(dequantize(type_name, data.reshape(-1), (rows, cols)), ref)
    assert_matches(dequantize(type_name, torch.from_numpy(data.copy()), (rows, cols)), ref)


@pytest.mark.parametrize("type_name", REF_QUANTIZABLE)
def test_quantized_random_values_match_reference(type_name: str):
    rng = np.random.default_rng(7)
    values = (rng.standard_normal((8, 256)) * rng.uniform(0.01, 3.0, size=(8, 1))).astype(np.float32)
    data = ref_quants.quantize(values, GGMLQuantizationType[type_name])
    ref = reference(type_name, data, values.shape)
    ours = dequantize(type_name, data, values.shape)
    assert_matches(ours, ref)
    # sanity: it really is an approximation of the input
    assert np.abs(ours.numpy() - values).max() < 0.2 * np.abs(values).max()


def test_float_types_accept_typed_and_byte_arrays():
    rng = np.random.default_rng(3)
    values = rng.standard_normal((5, 12)).astype(np.float32)
    out = dequantize("F32", values, values.shape)
    np.testing.assert_array_equal(out.numpy(), values)
    assert not np.shares_memory(out.numpy(), values)  # never aliases the (possibly read-only) source
    np.testing.assert_array_equal(dequantize("F32", values.view(np.uint8), values.shape).numpy(), values)

    half = values.astype(np.float16)
    np.testing.assert_array_equal(dequantize("F16", half, half.shape).numpy(), half.astype(np.float32))
    np.testing.assert_array_equal(dequantize("F16", half.view(np.uint8), half.shape).numpy(), half.astype(np.float32))

    bf16 = ref_quants.quantize(values, GGMLQuantizationType.BF16)  # uint8 (5, 24)
    ref = reference("BF16", bf16, values.shape)
    for form in (bf16, bf16.view(np.int16), bf16.view(np.uint16), bf16.reshape(-1)):
        assert_matches(dequantize("BF16", form, values.shape), ref)
    np.testing.assert_allclose(ref, values, rtol=1e-2)


def test_shapes_one_and_three_dimensional():
    data = random_blocks("Q4_K", 6, 256, seed=1)
    ref = reference("Q4_K", data, (2, 3, 256))
    assert_matches(dequantize("Q4_K", data, (2, 3, 256)), ref)
    assert_matches(dequantize("Q4_K", data.reshape(-1), (6 * 256,)), ref.reshape(-1))
    norm = np.arange(7, dtype=np.float32)
    np.testing.assert_array_equal(dequantize("F32", norm, (7,)).numpy(), norm)


def test_lowercase_and_enum_type_names():
    data = random_blocks("Q8_0", 2, 64, seed=2)
    ref = reference("Q8_0", data, (2, 64))
    assert_matches(dequantize("q8_0", data, (2, 64)), ref)
    assert_matches(dequantize(GGMLQuantizationType.Q8_0, data, (2, 64)), ref)


def test_unknown_type_is_a_load_error():
    with pytest.raises(ModelLoadError, match="IQ2_XXS"):
        dequantize("IQ2_XXS", np.zeros(66, dtype=np.uint8), (1, 256))
    with pytest.raises(ModelLoadError, match="NOT_A_TYPE"):
        dequantize("NOT_A_TYPE", np.zeros(4, dtype=np.uint8), (1,))


def test_wrong_byte_count_is_a_load_error():
    data = random_blocks("Q4_0", 2, 64, seed=4)
    with pytest.raises(ModelLoadError, match="Q4_0.*needs 72 bytes.*has 71"):
        dequantize("Q4_0", data.reshape(-1)[:-1], (2, 64))
    with pytest.raises(ModelLoadError, match="Q4_0"):
        dequantize("Q4_0", data, (3, 64))
    with pytest.raises(ModelLoadError, match="F32"):
        dequantize("F32", np.zeros(5, dtype=np.float32), (2, 3))


def test_row_not_a_multiple_of_block_size_is_a_load_error():
    with pytest.raises(ModelLoadError, match="Q6_K.*block size 256"):
        dequantize("Q6_K", np.zeros(210, dtype=np.uint8), (2, 128))


# ------------------------------------------------------------------------------------------------------------
# Real GGUF tensors: the smallest tensors of every type present in the two catalog files.


def _smallest_tensor_per_type(gguf: GGUFFile, per_type: int = 2) -> list[tuple[str, str]]:
    by_type: dict[str, list[tuple[int, str]]] = {}
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        by_type.setdefault(raw.type_name, []).append((int(np.prod(raw.shape)), name))
    return [(t, name) for t, items in sorted(by_type.items()) for _, name in sorted(items)[:per_type]]


@pytest.mark.parametrize("fixture", ["smollm2_gguf", "gemma3_gguf"])
def test_real_tensors_match_reference(fixture: str, request: pytest.FixtureRequest):
    path = request.getfixturevalue(fixture)
    gguf = GGUFFile(path)
    seen = set()
    for type_name, name in _smallest_tensor_per_type(gguf):
        raw = gguf.raw(name)
        if np.prod(raw.shape) > 4_000_000:  # e.g. SmolLM2's only Q8_0 tensor, the embedding: check 512 rows
            rows = (512, *raw.shape[1:])
            ref = reference(raw.type_name, raw.data[:512], rows)
            assert_matches(dequantize(raw.type_name, raw.data[:512], rows), ref)
        else:
            ref = reference(raw.type_name, raw.data, raw.shape)
            assert_matches(gguf.tensor(name), ref)  # GGUFFile.tensor dequantizes the memory map
        seen.add(type_name)
    expected = {"smollm2_gguf": {"Q4_1", "Q8_0", "F32"}, "gemma3_gguf": {"Q4_K", "Q5_0", "Q6_K", "Q8_0", "F32"}}
    assert expected[fixture] <= seen
