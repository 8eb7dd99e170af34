"""RoPE's inverse frequencies and cos / sin tables, computed with numpy (tables in whole blocks of positions).

Both runners take their tables from here (runlm.pytorch.nn.Rope for the PyTorch backend, runlm.native.model), so a
position's angles are the same bits in both: one ulp of difference in a table moves a quantized model's logits by
up to ~1 after its layers (int8 activation rounding amplifies it), which is far more than the two paths otherwise
differ (nothing: they run the same C++ blocks). A block's values do not depend on how many blocks came before it.
"""

from __future__ import annotations

import math

import numpy as np

from runlm.families.config import ModelConfig

ROPE_BLOCK = 1024  # positions per block of the RoPE tables


def table_block(inv_freq: np.ndarray, first: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin [ROPE_BLOCK, 2 * len(inv_freq)] float32 for positions first..first + ROPE_BLOCK - 1, in the
    rotate-half convention with the sign folded into sin: rotate_half(x) * sin == roll(x, D/2) * [-sin, sin].
    `scale`: YaRN's and LongRoPE's attention factor, multiplied into both where a pair turns: partial RoPE's
    pass-through pairs (frequency 0) keep their size, as in transformers and llama.cpp."""
    inv_freq = np.asarray(inv_freq, dtype=np.float32)
    positions = np.arange(first, first + ROPE_BLOCK, dtype=np.float32)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        factor = np.where(inv_freq != 0, np.float32(scale), np.float32(1))
        cos, sin = cos * factor, sin * factor
    return np.concatenate([cos, cos], axis=1), np.concatenate([-sin, sin], axis=1)


def _powers(dims: int, theta: float) -> np.ndarray:
    """theta ** (2i / dims) for each rotated pair i, in float32 step by step as transformers computes it."""
    f32 = np.float32
    return f32(theta) ** (np.arange(0, dims, 2, dtype=np.int64).astype(f32) / f32(dims))


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
             freq_factors: np.ndarray | None = None, long_context: bool = False) -> np.ndarray:
    """Inverse frequencies [head_dim / 2] float32, with linear or llama3 scaling (the kinds
    runlm.families.config.ROPE_SCALINGS lets through). Computed in float32 step by step as transformers computes
    them (`1 / theta ** (arange(0, D, 2) / D)`), so the tables stay within an ulp of its. `freq_factors` is GGUF's
    `rope_freqs` tensor: llama.cpp stores llama3 scaling as per-dimension divisors instead of config values. YaRN
    blends interpolated and original frequencies over a ramp of dimensions; LongRoPE divides each by its short or,
    with `long_context`, long factor.`head_dim` is the rotated part of a head where RoPE is partial."""
    f32 = np.float32
    base = f32(1.0) / _powers(head_dim, theta)
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
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        factors = scaling["long_factor" if long_context else "short_factor"]
        powers = _powers(head_dim, theta)
        return (f32(1.0) / (np.asarray(factors, dtype=f32) * powers)).astype(f32)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


def _yarn(dims: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN's frequencies, as transformers computes them (truncated correction range, betas 32 and 1 by default)."""
    f32 = np.float32
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    powers = _powers(dims, theta)
    extrapolated, interpolated = f32(1.0) / powers, f32(1.0) / (f32(factor) * powers)
    ramp = np.clip((np.arange(dims // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    keep = f32(1) - ramp
    return (interpolated * (f32(1) - keep) + extrapolated * keep).astype(f32)


def attention_factor(scaling: dict | None, max_position: int) -> float:
    """The factor YaRN and LongRoPE multiply cos and sin by (1 for the other scalings), unless the file sets it."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_position / original)
    if kind == "yarn":
        def mscale(m: float) -> float:
            return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

        if scaling.get("mscale") and scaling.get("mscale_all_dim"):  # DeepSeek's and Ministral 3's form
            return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
        return mscale(1.0)
    return math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0


def rope_frequencies(config: ModelConfig, freq_factors: np.ndarray | None = None,
                     context: int | None = None) -> list[tuple[np.ndarray, float]]:
    """Every RoPE a model's layers use, as (inverse frequencies [head dim / 2], cos / sin scale), in the order
    `rope_index` numbers them: the global one, the sliding-window layers' own base where they have one (over their own
    head size where it differs: Gemma 4), then zeros for layers without RoPE (cos 1, sin 0: the rows pass unchanged,
    bit for bit). Partial RoPE rotates the first rope_dims / 2 pairs and leaves the rest at zero frequency
    (FamilySpec.qk_rows_order puts each head's rotated values there). LongRoPE takes its long factors where the
    context a session may reach (`context`, default the model's) passes the original one, as llama.cpp chooses by its
    n_ctx. `freq_factors` (GGUF's rope_freqs) apply to the global RoPE only."""
    context = context or config.max_position
    layers = range(config.num_layers)

    def rope(theta: float, scaling: dict | None, width: int, rotated: int,
             factors: np.ndarray | None = None) -> tuple[np.ndarray, float]:
        original = (scaling or {}).get("original_max_position_embeddings") or config.max_position
        frequencies = inv_freq(rotated, theta, scaling, factors, long_context=context > original)
        padded = np.concatenate([frequencies, np.zeros((width - rotated) // 2, dtype=np.float32)])
        return padded, attention_factor(scaling, config.max_position)

    rotated = config.rope_dims or config.head_dim
    ropes = [rope(config.rope_theta, config.rope_scaling, config.head_dim, rotated, freq_factors)]
    if config.rope_local_theta is not None and any(config.is_sliding(i) for i in layers):
        width = config.sliding_head_dim or config.head_dim
        ropes.append(rope(config.rope_local_theta, config.local_rope_scaling, width,
                          width if config.sliding_head_dim else rotated))
    if not all(config.has_rope(i) for i in layers):
        ropes.append((np.zeros(config.head_dim // 2, dtype=np.float32), 1.0))
    return ropes


def rope_index(config: ModelConfig, layer: int) -> int:
    """Which of `rope_frequencies(config)` layer `layer` rotates with."""
    layers = range(config.num_layers)
    local = config.rope_local_theta is not None and any(config.is_sliding(i) for i in layers)
    if not config.has_rope(layer):
        return 1 + local
    return 1 if local and config.is_sliding(layer) else 0


__all__ = ["ROPE_BLOCK", "inv_freq", "rope_frequencies", "rope_index", "table_block"]
