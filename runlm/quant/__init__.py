"""GGML quantized tensors: reference dequantization, runlm's kernels on GGUF blocks, torch's int4 as the fallback."""

from __future__ import annotations

from runlm.quant.dequant import BLOCK_LAYOUTS, SUPPORTED_TYPES, dequantize
from runlm.quant.int4 import (
    FAST_INT4_DTYPES,
    INT4_TYPES,
    ConcatLinear,
    DenseLinear,
    Int4Linear,
    concat_linears,
    make_linear,
    pack_linear,
)

__all__ = [
    "BLOCK_LAYOUTS",
    "FAST_INT4_DTYPES",
    "INT4_TYPES",
    "SUPPORTED_TYPES",
    "ConcatLinear",
    "DenseLinear",
    "Int4Linear",
    "concat_linears",
    "dequantize",
    "make_linear",
    "pack_linear",
]
