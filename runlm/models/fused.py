"""How the decode step is fed to runlm's C++ kernels: chosen once per block, at load, here alone.

Family files build plain blocks (`runlm.nn.PreNormBlock`, `SandwichBlock`); `fuse_decode(model)` then
looks at each block's weights and, where every projection is a GGUF kernel linear, gives the block a
`fused_decode` callable that runs the whole block for one token in one C++ call. The callables
gather their weight arguments once (Python attribute lookups cost ~40 us a layer), so the choice is
redone whenever the weights move (`CachedRunner.to_device`).
"""

from __future__ import annotations

import torch
from torch import nn

from runlm.nn import Attention, PreNormBlock, SandwichBlock
from runlm.quant import kernels
from runlm.quant.int4 import ConcatLinear
from runlm.quant.kernels import GGUFLinear


class FusedPreNormDecode:
    """A llama-shaped block (no q/k norms, silu, full attention) for one token, in one call."""

    def __init__(self, block: PreNormBlock):
        attn, mlp = block.attn, block.mlp
        self.rope = id(attn.rope)
        self.weights = (
            block.attn_norm.scale, block.mlp_norm.scale, block.attn_norm.eps,
            attn.qkv.blocks, attn.qkv.type_id, attn.o_proj.blocks, attn.o_proj.type_id,
            mlp.gate_up.blocks, mlp.gate_up.type_id, mlp.down.blocks, mlp.down.type_id,
        )  # fmt: skip
        self.heads = (attn.n_heads, attn.n_kv_heads, attn.scale)

    @staticmethod
    def applies(block: PreNormBlock) -> bool:
        attn, mlp = block.attn, block.mlp
        return (
            all(isinstance(m, GGUFLinear) for m in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down))
            and attn.q_norm is None
            and attn.window is None
            and attn.softcap is None
            and mlp.activation == "silu"
        )

    def __call__(self, h: torch.Tensor, rope_tables, cache, start: int) -> torch.Tensor:
        cos, sin = rope_tables[self.rope]
        slot, _ = cache.prepare_decode(start)
        out = torch.ops.runlm.prenorm_decode_block.default(h, *self.weights, cos, sin, cache.k, cache.v, slot,
                                                           *self.heads)
        cache.commit(start + 1)
        return out


def _kernel_parts(module: nn.Module) -> list[GGUFLinear] | None:
    """The GGUF kernel linears a (possibly concatenated) projection is made of, or None."""
    pieces = list(module.parts) if isinstance(module, ConcatLinear) else [module]
    return pieces if all(isinstance(p, GGUFLinear) for p in pieces) else None


class FusedSandwichDecode:
    """A Gemma 3 block for one token in one call, over the full cache or the sliding-window ring.

    Projections may mix quant types (Gemma's Q5_0 / Q8_0), so q/k/v and gate/up go in as lists.
    """

    def __init__(self, block: SandwichBlock):
        attn, mlp = block.attn, block.mlp
        qkv, gate_up = _kernel_parts(attn.qkv), _kernel_parts(mlp.gate_up)
        o, down = _kernel_parts(attn.o_proj)[0], _kernel_parts(mlp.down)[0]
        self.rope = id(attn.rope)
        self.weights = (
            [block.pre_attn.scale, block.post_attn.scale, block.pre_mlp.scale, block.post_mlp.scale],
            block.pre_attn.eps, attn.q_norm.scale, attn.k_norm.scale,
            [p.blocks for p in qkv], [p.type_id for p in qkv], [p.out_features for p in qkv],
            o.blocks, o.type_id,
            [p.blocks for p in gate_up], [p.type_id for p in gate_up], [p.out_features for p in gate_up],
            down.blocks, down.type_id,
        )  # fmt: skip
        self.heads = (attn.n_heads, attn.n_kv_heads, attn.scale)

    @staticmethod
    def applies(block: SandwichBlock) -> bool:
        attn, mlp = block.attn, block.mlp
        singles = [_kernel_parts(attn.o_proj), _kernel_parts(mlp.down)]
        return (
            _kernel_parts(attn.qkv) is not None
            and _kernel_parts(mlp.gate_up) is not None
            and all(p is not None and len(p) == 1 for p in singles)
            and attn.q_norm is not None
            and attn.softcap is None
            and mlp.activation == "gelu_tanh"
        )

    def __call__(self, h: torch.Tensor, rope_tables, cache, start: int) -> torch.Tensor:
        cos, sin = rope_tables[self.rope]
        slot, live = cache.prepare_decode(start)
        out = torch.ops.runlm.sandwich_decode_block.default(h, *self.weights, cos, sin, cache.k, cache.v, slot, live,
                                                            *self.heads)
        cache.commit(start + 1)
        return out


FUSED_BLOCKS = {PreNormBlock: FusedPreNormDecode, SandwichBlock: FusedSandwichDecode}


def fuse_decode(layers: nn.ModuleList, dtype: torch.dtype, device: torch.device) -> int:
    """Set each block's fused decode (and its attention's fused decode attention) where the kernels
    apply: float32 on the CPU with runlm's C++ ops built. Returns how many blocks run fused."""
    native = dtype == torch.float32 and device.type == "cpu" and kernels.available()
    fused = 0
    for block in layers:
        fuser = FUSED_BLOCKS.get(type(block))
        block.fused_decode = fuser(block) if native and fuser is not None and fuser.applies(block) else None
        fused += block.fused_decode is not None
        attn: Attention = block.attn
        attn.fused_attention = native and attn.window is None and attn.softcap is None
    return fused


__all__ = ["FUSED_BLOCKS", "FusedPreNormDecode", "FusedSandwichDecode", "fuse_decode"]
