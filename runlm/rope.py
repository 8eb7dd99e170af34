"""RoPE's cos / sin tables, computed with numpy in whole blocks of positions.

Both runners take their tables from here (runlm.nn.Rope for the PyTorch path, runlm.lean.engine without it), so a
position's angles are the same bits in both: one ulp of difference in a table moves a quantized model's logits by
up to ~1 after its layers (int8 activation rounding amplifies it), which is far more than the two paths otherwise
differ (nothing: they run the same C++ blocks). A block's values do not depend on how many blocks came before it.
"""

from __future__ import annotations

import numpy as np

ROPE_BLOCK = 1024  # positions per block of the RoPE tables


def table_block(inv_freq: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin [ROPE_BLOCK, 2 * len(inv_freq)] float32 for positions first..first + ROPE_BLOCK - 1, in the
    rotate-half convention with the sign folded into sin: rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]."""
    positions = np.arange(first, first + ROPE_BLOCK, dtype=np.float32)
    angles = positions[:, None] * np.asarray(inv_freq, dtype=np.float32)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    return np.concatenate([cos, cos], axis=1), np.concatenate([-sin, sin], axis=1)


__all__ = ["ROPE_BLOCK", "table_block"]
