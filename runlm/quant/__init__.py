"""GGML quantized tensors: reference dequantization, runlm's kernels on GGUF blocks, torch's int4 as the fallback.

The names below are imported on first use: `runlm.quant.build` (how the kernels are compiled) is read by runlm.native's
decode process, which runs without PyTorch.
"""

from __future__ import annotations

from runlm import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "BLOCK_LAYOUTS": "runlm.quant.dequant",
    "SUPPORTED_TYPES": "runlm.quant.dequant",
    "dequantize": "runlm.quant.dequant",
    "FAST_INT4_DTYPES": "runlm.quant.int4",
    "INT4_TYPES": "runlm.quant.int4",
    "ConcatLinear": "runlm.quant.int4",
    "DenseLinear": "runlm.quant.int4",
    "Int4Linear": "runlm.quant.int4",
    "concat_linears": "runlm.quant.int4",
    "make_linear": "runlm.quant.int4",
    "pack_linear": "runlm.quant.int4",
})  # fmt: skip

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
