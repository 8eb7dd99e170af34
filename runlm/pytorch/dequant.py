"""Reference dequantization of GGML tensor types to float32, vectorized with torch.

Each GGML type stores a row as a sequence of fixed-size blocks (GGML_QUANT_SIZES: elements per block, bytes per
block). We view the raw bytes as a (n_blocks, type_size) uint8 tensor and decode every block at once with shifts,
masks and broadcasting, in chunks so the integer temporaries stay cache-sized. Float arithmetic follows the
order ggml uses (e.g. `(d * sc) * q - dmin * m`) so results match ggml / the gguf package bit for bit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from runlm.errors import ModelLoadError
from runlm.native.build import BLOCK_LAYOUTS, QK_K

SUPPORTED_TYPES: frozenset[str] = frozenset(BLOCK_LAYOUTS)

# Decode about this many output elements per chunk: big enough to amortize per-op overhead and let torch use
# its threads, small enough that the uint8/int temporaries stay in cache.
_CHUNK_ELEMENTS = 1 << 20

_U8 = torch.uint8


def _shifts(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=_U8)


_NIBBLE_SHIFTS = _shifts(0, 4)
_CRUMB_SHIFTS = _shifts(0, 2, 4, 6)
_BIT_SHIFTS = _shifts(0, 1, 2, 3, 4, 5, 6, 7)


# ---------------------------------------------------------------------------------------------------------------
# Input handling


def normalize_type_name(type_name: object) -> str:
    """Accept 'Q4_K', 'q4_k' or a GGMLQuantizationType member."""
    return str(getattr(type_name, "name", type_name)).upper()


def _layout(type_name: str) -> tuple[int, int]:
    layout = BLOCK_LAYOUTS.get(type_name)
    if layout is None:
        supported = ", ".join(sorted(BLOCK_LAYOUTS))
        raise ModelLoadError(f"unsupported GGUF tensor type {type_name!r} (runlm can read: {supported})")
    return layout


def _check_shape(shape: tuple[int, ...], type_name: str) -> tuple[int, int]:
    """(rows, cols) of a row-major shape; cols must hold whole blocks."""
    dims = tuple(int(d) for d in shape) or (1,)
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"{type_name} tensor has a negative dimension in shape {tuple(shape)}")
    block_size, _ = _layout(type_name)
    cols = dims[-1]
    if cols % block_size:
        raise ModelLoadError(
            f"{type_name} tensor shape {tuple(shape)}: row length {cols} "
            f"is not a multiple of the block size {block_size}"
        )
    return int(np.prod(dims[:-1], dtype=np.int64)), cols


def _raw_bytes(data: np.ndarray | torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 torch tensor, sharing memory with `data` where possible."""
    if isinstance(data, torch.Tensor):
        t = data.detach().cpu().contiguous().reshape(-1)
        return t.view(_U8) if t.dtype != torch.bool else t.to(_U8)
    arr = np.asarray(data)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    flat = arr.reshape(-1).view(np.uint8)
    if flat.flags.writeable:
        return torch.from_numpy(flat)
    with warnings.catch_warnings():
        # Memory-mapped GGUF data is read-only; we only ever read from this view.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(flat)


def _blocks(type_name: str, data: np.ndarray | torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate the byte count against the shape and return the (n_blocks, type_size) uint8 view."""
    block_size, type_size = _layout(type_name)
    rows, cols = _check_shape(shape, type_name)
    raw = _raw_bytes(data)
    expected = rows * (cols // block_size) * type_size
    if raw.numel() != expected:
        raise ModelLoadError(
            f"{type_name} tensor of shape {tuple(shape)} needs {expected} bytes "
            f"({block_size} values per {type_size}-byte block) but has {raw.numel()}"
        )
    return raw.view(-1, type_size)


# ---------------------------------------------------------------------------------------------------------------
# Bit-field helpers (all on uint8 tensors)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian float16 at byte `offset` of every block, as float32 of shape (n_blocks, 1)."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Split (..., n) bytes into (..., 2n): all low nibbles, then all high nibbles (ggml's 4-bit order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _fields(qs: torch.Tensor, shifts: torch.Tensor, mask: int) -> torch.Tensor:
    """(..., n) bytes -> (..., len(shifts), n): the bit field at each shift, for every byte."""
    return (qs.unsqueeze(-2) >> shifts.view(-1, 1)) & mask


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte Q4_K/Q5_K scale field into 8 six-bit scales and 8 six-bit mins (uint8, (nb, 8))."""
    a, b, c = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return sc, mn


def _float(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Per-type block decoders: (n_blocks, type_size) uint8 -> write (n_blocks, block_size) float32 into `out`.
# Integer work stays in uint8/int8 until one vectorized copy_ converts it into `out`; float math is then in place.


def _dq_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qs[16]: element j in the low nibble of byte j, element j+16 in its high nibble
    out.copy_(_nibbles(b[:, 2:18]).to(torch.int8) - 8).mul_(_f16(b, 0))


def _dq_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | m: f16 | qs[16]
    out.copy_(_nibbles(b[:, 4:20])).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_values(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1 5-bit values 0..31: bit j of the 32-bit little-endian qh is the high bit of element j."""
    high = _fields(qh, _BIT_SHIFTS, 1).transpose(1, 2).reshape(qh.shape[0], 32)  # byte j//8, bit j%8
    return _nibbles(qs) | (high << 4)


def _dq_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qh: u32 | qs[16]
    out.copy_(_q5_values(b[:, 2:6], b[:, 6:22]).to(torch.int8) - 16).mul_(_f16(b, 0))


def _dq_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | m: f16 | qh: u32 | qs[16]
    out.copy_(_q5_values(b[:, 4:8], b[:, 8:24])).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _dq_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | qs: int8[32]
    out.copy_(b[:, 2:34].view(torch.int8)).mul_(_f16(b, 0))


def _dq_q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # scales[16] (low nibble scale, high nibble min) | qs[64] | d: f16 | dmin: f16
    # Element h*128 + s*32 + r sits in byte qs[h*32 + r] at bits 2s; its 16-wide sub-block is element // 16.
    nb = b.shape[0]
    scales = b[:, 0:16]
    dl = (_f16(b, 80) * _float(scales & 0x0F)).unsqueeze(-1)
    ml = (_f16(b, 82) * _float(scales >> 4)).unsqueeze(-1)
    q = _fields(b[:, 16:80].reshape(nb, 2, 32), _CRUMB_SHIFTS, 3).view(nb, 16, 16)
    out.view(nb, 16, 16).copy_(q).mul_(dl).sub_(ml)


def _dq_q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # hmask[32] | qs[64] | scales[12] (16 six-bit scales) | d: f16
    # Low 2 bits as in Q2_K; the high bit of element e is bit e//32 of hmask[e % 32], and a *clear* bit means -4.
    nb = b.shape[0]
    sc = b[:, 96:108]
    low = _fields(sc[:, 0:8], _NIBBLE_SHIFTS, 0x0F).reshape(nb, 16)  # scale k: byte k%8, nibble k//8
    high = _fields(sc[:, 8:12], _CRUMB_SHIFTS, 3).reshape(nb, 16)  # scale k: byte 8 + k%4, bits 2*(k//4)
    scale = (low | (high << 4)).to(torch.int8) - 32
    dl = (_f16(b, 108) * _float(scale)).unsqueeze(-1)
    ql = _fields(b[:, 32:96].reshape(nb, 2, 32), _CRUMB_SHIFTS, 3).view(nb, QK_K)
    hm = _fields(b[:, 0:32], _BIT_SHIFTS, 1).view(nb, QK_K)
    q = (ql | (hm << 2)).to(torch.int8) - 4
    out.view(nb, 16, 16).copy_(q.view(nb, 16, 16)).mul_(dl)


def _k4_values(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K low nibbles: each 32-byte group holds 64 elements (low nibbles first), (nb, 256)."""
    return _nibbles(qs.reshape(qs.shape[0], 4, 32)).reshape(qs.shape[0], QK_K)


def _dq_k_affine(b: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K/Q5_K: element of 32-wide sub-block j is (d * sc[j]) * q - dmin * m[j]."""
    nb = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * _float(sc)).unsqueeze(-1)
    ml = (_f16(b, 2) * _float(mn)).unsqueeze(-1)
    out.view(nb, 8, 32).copy_(q.view(nb, 8, 32)).mul_(dl).sub_(ml)


def _dq_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | dmin: f16 | scales[12] | qs[128]
    _dq_k_affine(b, _k4_values(b[:, 16:144]), out)


def _dq_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # d: f16 | dmin: f16 | scales[12] | qh[32] | qs[128]; high bit of element e: bit e//32 of qh[e % 32]
    nb = b.shape[0]
    high = _fields(b[:, 16:48], _BIT_SHIFTS, 1).view(nb, QK_K)
    _dq_k_affine(b, _k4_values(b[:, 48:176]) | (high << 4), out)


def _dq_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # ql[128] | qh[64] | scales: int8[16] | d: f16
    # Element h*128 + k*32 + l: low 4 bits in ql[h*64 + (k%2)*32 + l] (nibble k//2), high 2 bits in
    # qh[h*32 + l] at bits 2k; value - 32 times d * scales[element // 16].
    nb = b.shape[0]
    ql = _nibbles(b[:, 0:128].reshape(nb, 2, 64)).view(nb, QK_K)
    qh = _fields(b[:, 128:192].reshape(nb, 2, 32), _CRUMB_SHIFTS, 3).view(nb, QK_K)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    dl = (_f16(b, 208) * _float(b[:, 192:208].view(torch.int8))).unsqueeze(-1)
    out.view(nb, 16, 16).copy_(q.view(nb, 16, 16)).mul_(dl)


# IQ4_NL / IQ4_XS: each 4-bit code picks one of 16 non-uniform levels (ggml's kvalues_iq4nl)
_IQ4_LEVELS = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                           dtype=torch.float32)
_SUB_BLOCKS = torch.arange(8)


def _dq_iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_IQ4_LEVELS[_nibbles(b[:, 2:18]).long()]).mul_(_f16(b, 0))


def _dq_iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    """256 values: f16 d, 8 six-bit sub-block scales (low 4 bits in 4 bytes, high 2 in a u16), 128 code bytes."""
    nb = b.shape[0]
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    low = (b[:, 4:8][:, _SUB_BLOCKS // 2].to(torch.int32) >> (4 * (_SUB_BLOCKS % 2))) & 0xF
    scales = low | (((high >> (2 * _SUB_BLOCKS)) & 3) << 4)
    dl = (_f16(b, 0) * (scales - 32).to(torch.float32)).unsqueeze(-1)
    codes = _nibbles(b[:, 8:136].reshape(nb, 8, 16))
    out.view(nb, 8, 32).copy_(_IQ4_LEVELS[codes.long()]).mul_(dl)


# MXFP4: 32 E2M1 codes (their values doubled, as integers) and one E8M0 exponent e: values x 2^(e - 128)
_MXFP4_LEVELS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _dq_mxfp4(b: torch.Tensor, out: torch.Tensor) -> None:
    scale = torch.ldexp(torch.ones(b.shape[0], 1), b[:, :1].to(torch.int32) - 128)
    out.copy_(_MXFP4_LEVELS[_nibbles(b[:, 1:17]).long()]).mul_(scale)


_BLOCK_DECODERS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "Q4_0": _dq_q4_0,
    "Q4_1": _dq_q4_1,
    "Q5_0": _dq_q5_0,
    "Q5_1": _dq_q5_1,
    "Q8_0": _dq_q8_0,
    "Q2_K": _dq_q2_k,
    "Q3_K": _dq_q3_k,
    "Q4_K": _dq_q4_k,
    "Q5_K": _dq_q5_k,
    "Q6_K": _dq_q6_k,
    "IQ4_NL": _dq_iq4_nl,
    "IQ4_XS": _dq_iq4_xs,
    "MXFP4": _dq_mxfp4,
}

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------------------------
# Public entry points


def dequantize(type_name: str, data: np.ndarray | torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a GGML tensor's raw data into a new float32 tensor of the row-major `shape`.

    `data` may be the reader's uint8 array (rows, bytes_per_row) or flat, or a typed float array for F32/F16
    (BF16 as uint8/int16/uint16); only its bytes matter. Raises ModelLoadError for an unsupported type or a byte
    count that does not match the shape.
    """
    name = normalize_type_name(type_name)
    blocks = _blocks(name, data, tuple(shape))
    out_shape = tuple(int(d) for d in shape)
    float_dtype = _FLOAT_DTYPES.get(name)
    if float_dtype is not None:
        # clone/convert: never hand out a tensor aliasing the (read-only) memory map
        return blocks.reshape(-1).view(float_dtype).to(torch.float32, copy=True).reshape(out_shape)
    decode = _BLOCK_DECODERS[name]
    block_size = BLOCK_LAYOUTS[name][0]
    n_blocks = blocks.shape[0]
    out = torch.empty(n_blocks, block_size, dtype=torch.float32)
    step = max(1, _CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        decode(blocks[start:stop], out[start:stop])
    return out.reshape(out_shape)


def int4_groups(
    type_name: str, data: np.ndarray | torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K as 32-wide groups: (q uint8 [N, K] in 0..15, scale f32 [N, K/32], offset f32 [N, K/32]).

    Every weight is exactly `scale * q + offset` of its group (in real arithmetic; the f32 values here are exact
    products of the stored f16 fields and small integers), which is what group-wise int4 matmul kernels need.
    """
    name = normalize_type_name(type_name)
    if name not in ("Q4_0", "Q4_1", "Q4_K"):
        raise ModelLoadError(f"{name} is not a 4-bit group-wise type (expected Q4_0, Q4_1 or Q4_K)")
    if len(shape) != 2:
        raise ModelLoadError(f"{name} linear weight must be 2-D, got shape {tuple(shape)}")
    rows, cols = int(shape[0]), int(shape[1])
    blocks = _blocks(name, data, (rows, cols))
    if name == "Q4_0":
        q = _nibbles(blocks[:, 2:18])
        scale = _f16(blocks, 0)
        offset = scale * -8.0
    elif name == "Q4_1":
        q = _nibbles(blocks[:, 4:20])
        scale = _f16(blocks, 0)
        offset = _f16(blocks, 2)
    else:
        q = _k4_values(blocks[:, 16:144])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scale = _f16(blocks, 0) * _float(sc)
        offset = -(_f16(blocks, 2) * _float(mn))
    groups = cols // 32
    return q.reshape(rows, cols), scale.reshape(rows, groups), offset.reshape(rows, groups)
