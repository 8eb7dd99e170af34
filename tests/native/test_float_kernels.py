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

# K: below one vector, several vectors with a tail, and past 4096 values (a GEMV shared by threads, rows left over);
# 150 rows: each thread's half holds whole blocks of 32 weight rows (float_block, K in chunks) and tiles left over
SHAPES = [(37, 5), (37, 1000), (23, 4107), (150, 1000)]
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


def test_row_layout_weights_are_read_in_place_and_regrouped_ones_are_copied(tmp_path):
    """Float projections, and quantized ones in a type this build keeps in the file's row layout (IQ4_NL, which no
    build regroups), run on the file's map; a type the build regroups (Q8_0 on a SIMD build) is copied into its
    groups, and so is a weight whose rows are reordered. Stacked with mixed types (q/k/v), each part is read as its
    type alone would be; in place or copied, the results are the file's rows'."""
    import gguf
    from reference.bare_weights import bare_weights
    from reference.quant_blocks import random_blocks

    from runlm.native.build import KERNEL_TYPES, RUN_TYPES, X4

    rows, cols = 32, 64
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    q8 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    iq4 = random_blocks("IQ4_NL", rows, cols, seed=2)
    file, reader = bare_weights(tmp_path / "mixed.gguf", {"f16.weight": values.astype(np.float16),
                                                          "q8.weight": (q8, gguf.GGMLQuantizationType.Q8_0),
                                                          "iq4.weight": (iq4, gguf.GGMLQuantizationType.IQ4_NL)})
    f16_raw, q8_raw, iq4_raw = (file.raw(f"{name}.weight") for name in ("f16", "q8", "iq4"))
    alone = reader._linear([f16_raw, f16_raw], [None, None]) + reader._linear([iq4_raw, iq4_raw], [None, None])
    assert all(np.shares_memory(part.data, raw.data) for part, raw in zip(alone, [f16_raw] * 2 + [iq4_raw] * 2))
    mixed = reader._linear([f16_raw, q8_raw, iq4_raw], [None, None, None])
    assert np.shares_memory(mixed[0].data, f16_raw.data) and np.shares_memory(mixed[2].data, iq4_raw.data)
    regrouped = reader._group("Q8_0", [q8_raw]) > 0
    assert regrouped == library.simd()
    assert np.shares_memory(mixed[1].data, q8_raw.data) != regrouped
    assert mixed[1].type_id == KERNEL_TYPES["Q8_0"] + (X4 if regrouped else 0)
    reversed_rows = list(range(rows))[::-1]
    moved = reader._linear([iq4_raw], [reversed_rows])[0]
    assert not np.shares_memory(moved.data, iq4_raw.data)

    x = np.random.default_rng(1).standard_normal((3, cols)).astype(np.float32)

    def file_rows(raw) -> np.ndarray:
        return library.linear(x, np.array(raw.data).view(np.uint8).reshape(rows, -1), RUN_TYPES[raw.type_name], rows)

    for part, raw in zip(mixed, (f16_raw, q8_raw, iq4_raw)):
        plain = file_rows(raw)
        # the interleaved layout sums a 32-wide type's blocks in another float order: equal to float rounding
        np.testing.assert_allclose(library.linear(x, part.data, part.type_id, rows), plain, rtol=0,
                                   atol=1e-6 * np.abs(plain).max())
    np.testing.assert_array_equal(library.linear(x, moved.data, moved.type_id, rows), file_rows(iq4_raw)[:, ::-1])
