"""Linear layers that keep GGUF weights packed where PyTorch has a CPU kernel for the format.

PyTorch ships a group-wise int4 matmul for CPU (`aten._weight_int4pack_mm_for_cpu`, the tinygemm kernel used by
gpt-fast / torchao). Measured facts for torch 2.13 (see tests/quant/test_packed.py):

* weight element = (q - 8) * scale + zero, q in 0..15, one (scale, zero) pair per `group_size` consecutive input
  features of an output row; `scales_and_zeros` has shape [K / group_size, N, 2] and the activation's dtype.
* group_size must be 32, 64, 128 or 256; K % group_size == 0; N % 16 == 0; x must be 2-D and contiguous.
* x may be bfloat16, float16 or float32, but only bfloat16 has a vectorized (AVX2/AVX512) kernel: float32 and
  float16 run a scalar fallback ~10-25x slower than a dense float32 matmul, so they are useless for speed.
* the packed weight comes from `aten._convert_weight_to_int4pack_for_cpu(int32 [N, K], inner_k_tiles)` and is
  uint8 [N, K/2]; its byte order depends on the CPU capability (blocks of 32 output rows on AVX2, 64 on AVX512),
  so we always go through the official converter and never build the bytes ourselves. Blocks never span rows
  of different BLOCK_N tiles, so packed tensors whose row counts are multiples of 64 concatenate along dim 0.

Q4_0 (d*(q-8)), Q4_1 (d*q + m) and Q4_K ((d*sc)*q - dmin*mn per 32-wide sub-block) are exactly this form with
group_size 32; the only loss is rounding scale/zero to bfloat16 (plus bfloat16 activations and output).
Q8_0 has one scale per 32 inputs, which per-output-channel int8 kernels (`aten._weight_int8pack_mm`) cannot
express without requantizing, so it gets no packed module; neither do 5/6-bit types.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runlm.errors import InvalidInputError
from runlm.pytorch.dequant import dequantize, int4_groups, normalize_type_name
from runlm.pytorch.kernels import concat_gguf_linears

INT4_TYPES: frozenset[str] = frozenset({"Q4_0", "Q4_1", "Q4_K"})
GROUP_SIZE = 32
# Activation dtypes for which the int4 kernel is vectorized; other dtypes hit a slow scalar loop.
FAST_INT4_DTYPES: frozenset[torch.dtype] = frozenset({torch.bfloat16})
# Output rows converted per call to the packer (bounds the int32 temporary it needs); a multiple of every
# known kernel row tile (32 on AVX2, 64 on AVX512) so chunk outputs concatenate into the whole-matrix layout.
_PACK_ROWS = 4096
_ROW_TILE = 64


def int4_kernel_available() -> bool:
    """Whether this torch build has the CPU int4 pack + matmul ops."""
    aten = torch.ops.aten
    return hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")


class DenseLinear(nn.Module):
    """x @ W.T with a plain weight (stored in the compute dtype): the fallback behind the same interface."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise InvalidInputError(f"linear weight must be 2-D, got shape {tuple(weight.shape)}")
        weight = weight.detach()
        if dtype is not None:
            weight = weight.to(dtype)
        self.register_buffer("weight", weight.contiguous())
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        # One row at a time: a float GEMM's result for a row depends on how many rows share the call (BLAS picks
        # other kernels), so a route-invariant model runs a plain head this way (set by runlm.pytorch.fused).
        self.row_by_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        rows = x.reshape(-1, x.shape[-1]).to(weight.dtype)
        if self.row_by_row and rows.shape[0] > 1:
            out = torch.cat([F.linear(row, weight) for row in rows.split(1)])
            return out.view(*x.shape[:-1], -1).to(x.dtype)
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"


class Int4Linear(nn.Module):
    """Group-wise int4 weight (weight = (q - 8) * scale + zero) run by PyTorch's packed CPU kernel.

    The kernel dtype is the dtype of `scales_and_zeros`; forward casts x to it and the result back to x's dtype.
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, group_size: int):
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.in_features = int(in_features)
        self.out_features = int(scales_and_zeros.shape[1])
        self.group_size = int(group_size)

    @classmethod
    def from_groups(cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
        """Build from q uint8 [N, K] (0..15) with weight = scale * q + offset per 32-wide group ([N, K/32])."""
        rows, cols = q.shape
        group_size = cols // scale.shape[1]
        # (q - 8) * s + z == s * q + offset  <=>  z = offset + 8 * s (exact in float32 for GGUF's f16 fields).
        zero = offset + 8.0 * scale
        scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
        convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        parts = [convert(q[start : start + _PACK_ROWS].to(torch.int32), 1) for start in range(0, rows, _PACK_ROWS)]
        packed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return cls(packed, scales_and_zeros, cols, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(self.scales_and_zeros.dtype).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_and_zeros)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
            f"dtype={self.scales_and_zeros.dtype}"
        )


class ConcatLinear(nn.Module):
    """Several linears over the same input, outputs concatenated: used when their weights cannot be merged."""

    def __init__(self, parts: Sequence[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = int(parts[0].in_features)
        self.out_features = sum(int(p.out_features) for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def pack_linear(
    type_name: str,
    data: np.ndarray | torch.Tensor,
    shape: tuple[int, int],
    compute_dtype: torch.dtype,
    *,
    allow_slow_kernel: bool = False,
) -> nn.Module | None:
    """A packed linear for a GGUF weight of row-major `shape` (out_features, in_features), or None.

    None means no fast kernel for this type / dtype / shape: the caller should dequantize instead (see
    `make_linear`). `data` is the raw GGUF bytes, (rows, bytes_per_row) or flat; rows may already be permuted.
    Only bfloat16 has a fast int4 kernel; `allow_slow_kernel` builds the module for float32/float16 anyway
    (scalar fallback, for exactness checks).
    """
    name = normalize_type_name(type_name)
    if name not in INT4_TYPES or len(shape) != 2 or not int4_kernel_available():
        return None
    if compute_dtype not in FAST_INT4_DTYPES and not (
        allow_slow_kernel and compute_dtype in (torch.float32, torch.float16)
    ):
        return None
    rows, cols = int(shape[0]), int(shape[1])
    if rows == 0 or rows % 16 or cols % GROUP_SIZE:
        return None
    q, scale, offset = int4_groups(name, data, (rows, cols))
    return Int4Linear.from_groups(q, scale, offset, compute_dtype)


def make_linear(
    type_name: str,
    data: np.ndarray | torch.Tensor,
    shape: tuple[int, int],
    compute_dtype: torch.dtype,
    *,
    packed: bool = True,
) -> nn.Module:
    """The packed module when one exists (and `packed`), else a DenseLinear of the dequantized weight."""
    if packed:
        module = pack_linear(type_name, data, shape, compute_dtype)
        if module is not None:
            return module
    return DenseLinear(dequantize(type_name, data, shape), dtype=compute_dtype)


def concat_linears(modules: Sequence[nn.Module]) -> nn.Module:
    """One module computing all `modules` on the same input, outputs concatenated along the last dim.

    Dense weights of one dtype merge into one DenseLinear; int4 modules with the same group size and dtype
    merge in packed form (when every part but the last has a row count that is a multiple of the kernel's row
    tile); anything else becomes a ConcatLinear that runs the parts one after another.
    """
    modules = list(modules)
    if not modules:
        raise InvalidInputError("concat_linears needs at least one module")
    in_features = {int(m.in_features) for m in modules}
    if len(in_features) != 1:
        raise InvalidInputError(f"cannot concatenate linears with different in_features {sorted(in_features)}")
    if len(modules) == 1:
        return modules[0]
    merged = concat_gguf_linears(modules)
    if merged is not None:
        return merged
    if all(isinstance(m, DenseLinear) for m in modules) and len({m.weight.dtype for m in modules}) == 1:
        return DenseLinear(torch.cat([m.weight for m in modules], dim=0))
    if (
        all(isinstance(m, Int4Linear) for m in modules)
        and len({(m.group_size, m.scales_and_zeros.dtype) for m in modules}) == 1
        and all(m.out_features % _ROW_TILE == 0 for m in modules[:-1])
    ):
        return Int4Linear(
            torch.cat([m.packed for m in modules], dim=0),
            torch.cat([m.scales_and_zeros for m in modules], dim=1),
            modules[0].in_features,
            modules[0].group_size,
        )
    flat: list[nn.Module] = []
    for m in modules:
        flat.extend(m.parts if isinstance(m, ConcatLinear) else [m])
    return ConcatLinear(flat)
