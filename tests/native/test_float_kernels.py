"""The float-weight kernels (F32, F16, BF16 read in place) of this CPU's build, through `rl_linear`.

* Against float64 over the widened weights: within 1e-5 relative (float32 accumulation only).
* Each weight value widens exactly (a one-hot activation row reads one weight column back, bit for bit).
* Route invariance: an output row is the same bits whether its activation row comes alone (a decode step's GEMV,
  four far-apart weight rows at a time and the rest one by one) or among others (a prefill tile), as the block
  needs.
"""

import numpy as np
import pytest

from runlm.native import library
from runlm.native.build import FLOAT_KERNEL_TYPES

# K: below one vector, several vectors with a tail, and past 4096 values (a GEMV shared by threads, rows left over)
SHAPES = [(37, 5), (37, 1000), (23, 4107)]
ROWS = [1, 2, 3, 4, 7, 13]


def float_weights(type_name: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(the file's bytes [n, k * width], the values they hold as float64)."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    if type_name == "F32":
        stored = values
        widened = values
    elif type_name == "F16":
        stored = values.astype(np.float16)
        widened = stored.astype(np.float32)
    else:  # BF16: the top half of each float32 (truncated; any 16-bit pattern but NaN is a valid value)
        stored = (values.view(np.uint32) >> 16).astype(np.uint16)
        widened = (stored.astype(np.uint32) << 16).view(np.float32)
    return np.ascontiguousarray(stored).view(np.uint8).reshape(n, -1), widened.astype(np.float64)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("n, k", SHAPES)
def test_float_linear_matches_float64_and_rows_do_not_depend_on_their_batch(type_name, n, k):
    library.set_threads(2)
    blocks, widened = float_weights(type_name, n, k, seed=k)
    x = np.random.default_rng(k + 1).standard_normal((max(ROWS), k)).astype(np.float32)
    reference = x.astype(np.float64) @ widened.T
    alone = np.stack([library.linear(x[i : i + 1], blocks, FLOAT_KERNEL_TYPES[type_name], n)[0]
                      for i in range(max(ROWS))])
    assert np.abs(alone - reference).max() <= 1e-5 * np.abs(reference).max()
    for m in ROWS:
        together = library.linear(x[:m], blocks, FLOAT_KERNEL_TYPES[type_name], n)
        np.testing.assert_array_equal(together, alone[:m], err_msg=f"{type_name} M={m} K={k}")


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_each_float_weight_widens_exactly(type_name):
    n, k = 9, 45  # two 16-value steps and a tail of 13
    blocks, widened = float_weights(type_name, n, k, seed=3)
    one_hot = np.eye(k, dtype=np.float32)
    columns = library.linear(one_hot, blocks, FLOAT_KERNEL_TYPES[type_name], n)
    np.testing.assert_array_equal(columns.T, widened.astype(np.float32))


def test_float_weights_are_read_in_place_and_a_quantized_one_beside_them_is_not(tmp_path):
    """Float projections run on the file's map; stacked with a quantized one (q/k/v of mixed types), each is copied as
    a part of its own, the quantized one regrouped as every quantized projection is, never read in place."""
    import gguf
    from reference.bare_weights import bare_weights

    from runlm.native.build import KERNEL_TYPES, X4

    rows, cols = 32, 64
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    file, reader = bare_weights(tmp_path / "mixed.gguf", {"f16.weight": values.astype(np.float16),
                                                          "q8.weight": (q8, gguf.GGMLQuantizationType.Q8_0)})
    floats = [file.raw("f16.weight"), file.raw("f16.weight")]
    assert all(np.shares_memory(part.data, raw.data) for part, raw in zip(reader._linear(floats, [None, None]), floats))
    mixed = reader._linear([file.raw("f16.weight"), file.raw("q8.weight")], [None, None])
    np.testing.assert_array_equal(mixed[0].data, file.raw("f16.weight").data.view(np.uint8))
    assert not np.shares_memory(mixed[1].data, file.raw("q8.weight").data)
    assert mixed[1].type_id in (KERNEL_TYPES["Q8_0"], KERNEL_TYPES["Q8_0"] + X4)
    x = np.random.default_rng(1).standard_normal((3, cols)).astype(np.float32)
    # the interleaved layout sums a 32-wide type's blocks in another float order: equal to float rounding
    plain = library.linear(x, file.raw("q8.weight").data, KERNEL_TYPES["Q8_0"], rows)
    np.testing.assert_allclose(library.linear(x, mixed[1].data, mixed[1].type_id, rows), plain,
                               rtol=0, atol=1e-6 * np.abs(plain).max())
