"""Random GGUF blocks for the quantization tests: random bytes with finite float16 scale fields."""

from __future__ import annotations

import numpy as np
import torch

from runlm.native.build import BLOCK_LAYOUTS

# Byte offsets of the float16 scale fields inside one block of each type.
F16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
    "MXFP4": [],  # its scale is an exponent byte (E8M0_EXPONENTS)
}
# Exponent bytes of the E8M0 scales drawn for MXFP4 blocks: 2^-10 ... 2^-2 (the scale is 2^(e - 128))
E8M0_EXPONENTS = (118, 127)


def random_blocks(type_name: str, rows: int, cols: int, seed: int, signed_scales: bool = False) -> np.ndarray:
    """Random bytes in the type's layout, [rows, row_bytes], every f16 scale finite and moderate.

    `signed_scales` draws scales around zero (both signs); otherwise small positive scales, which keep
    matmul outputs well away from zero for relative-error checks.
    """
    block_size, type_size = BLOCK_LAYOUTS[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[type_name]:
        if signed_scales:
            scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        else:
            scales = (rng.uniform(0.2, 1.0, blocks.shape[0]) * 0.02).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if type_name == "MXFP4":
        blocks[:, 0] = rng.integers(*E8M0_EXPONENTS, size=blocks.shape[0], endpoint=True)
    return blocks.reshape(rows, -1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of `out` against `ref`, in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()
