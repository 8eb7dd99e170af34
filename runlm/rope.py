"""RoPE's inverse frequencies and cos / sin tables, computed with numpy (tables in whole blocks of positions).

Both runners take their tables from here (runlm.nn.Rope for the PyTorch path, runlm.native.model without it), so a
position's angles are the same bits in both: one ulp of difference in a table moves a quantized model's logits by
up to ~1 after its layers (int8 activation rounding amplifies it), which is far more than the two paths otherwise
differ (nothing: they run the same C++ blocks). A block's values do not depend on how many blocks came before it.
"""

from __future__ import annotations

import math

import numpy as np

from runlm.families.config import ModelConfig

ROPE_BLOCK = 1024  # positions per block of the RoPE tables


def table_block(inv_freq: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin [ROPE_BLOCK, 2 * len(inv_freq)] float32 for positions first..first + ROPE_BLOCK - 1, in the
    rotate-half convention with the sign folded into sin: rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]."""
    positions = np.arange(first, first + ROPE_BLOCK, dtype=np.float32)
    angles = positions[:, None] * np.asarray(inv_freq, dtype=np.float32)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    return np.concatenate([cos, cos], axis=1), np.concatenate([-sin, sin], axis=1)


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
             freq_factors: np.ndarray | None = None) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] float32, with linear or llama3 scaling (the kinds
    runlm.families.config.ROPE_SCALINGS lets through). Computed in float32 step by step as transformers computes
    them (`1 / theta ** (arange(0, D, 2) / D)`), so the tables stay within an ulp of its. `freq_factors` is GGUF's
    `rope_freqs` tensor: llama.cpp stores llama3 scaling as per-dimension divisors instead of config values."""
    f32 = np.float32
    base = f32(1.0) / (f32(theta) ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)))
    if freq_factors is not None:
        return base / np.asarray(freq_factors, dtype=f32)
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return base
    if kind == "linear":
        return base / f32(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (f32(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old_ctx = f32(scaling["original_max_position_embeddings"])
        wavelen = f32(2 * math.pi) / base
        scaled = np.where(wavelen > old_ctx / low, base / factor, base)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return np.where(medium, smoothed, scaled).astype(f32)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def rope_frequencies(config: ModelConfig, freq_factors: np.ndarray | None = None) -> list[np.ndarray]:
    """Every RoPE a model's layers use, in the order `rope_index` numbers them: the global one, the sliding-window
    layers' own base where they have one, then zeros for layers without RoPE (cos 1, sin 0: the rows pass unchanged,
    bit for bit)."""
    layers = range(config.num_layers)
    ropes = [inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, freq_factors)]
    if config.rope_local_theta is not None and any(config.is_sliding(i) for i in layers):
        ropes.append(inv_freq(config.head_dim, config.rope_local_theta, config.local_rope_scaling))
    if not all(config.has_rope(i) for i in layers):
        ropes.append(np.zeros(config.head_dim // 2, dtype=np.float32))
    return ropes


def rope_index(config: ModelConfig, layer: int) -> int:
    """Which of `rope_frequencies(config)` layer `layer` rotates with."""
    layers = range(config.num_layers)
    local = config.rope_local_theta is not None and any(config.is_sliding(i) for i in layers)
    if not config.has_rope(layer):
        return 1 + local
    return 1 if local and config.is_sliding(layer) else 0


__all__ = ["ROPE_BLOCK", "inv_freq", "rope_frequencies", "rope_index", "table_block"]
