"""How blocks are fed to runlm's C++ kernels: chosen once per block, at load, here alone.

Family files build plain blocks (`runlm.pytorch.nn.PreNormBlock`, `SandwichBlock`); `fuse_blocks(model)` then looks at
each block's weights and, where every projection is a GGUF kernel linear, gives the block a `fused` callable that
runs the whole block in one C++ call for any rows: a prefill chunk of one sequence, one decode step, or one step of
a batch of sequences. Every stage of that call is computed row by row, so a token's result does not depend on the
route it took (see block.h, "Route-invariant blocks"). A block reaches C as the native runtime's blocks do, one
`runlm.native.library.Block` (RlBlock) pointing into the block's tensors, made once: the choice is redone whenever
the weights move (`CachedRunner.to_device`).
"""

from __future__ import annotations

import ctypes
from functools import cached_property

import torch
from torch import nn

from runlm.families.spec import ACTIVATIONS
from runlm.native.library import Block, Weight
from runlm.pytorch import kernels
from runlm.pytorch.int4 import ConcatLinear, DenseLinear
from runlm.pytorch.kernels import GGUFLinear
from runlm.pytorch.nn import Attention, PreNormBlock, RMSNorm, SandwichBlock


def _kernel_parts(module: nn.Module) -> list[GGUFLinear] | None:
    """The GGUF kernel linears a (possibly concatenated) projection is made of, or None."""
    pieces = list(module.parts) if isinstance(module, ConcatLinear) else [module]
    return pieces if all(isinstance(p, GGUFLinear) for p in pieces) else None


class Rows:
    """A forward's rows: which sequence and position each one is, and the RoPE tables cut to rows. Made once per
    forward and shared by every block (the per-block Python cost is what a small model's decode step pays)."""

    def __init__(self, starts: list[int], counts: list[int], rope_tables: dict):
        self.starts, self.counts = starts, counts
        self.total = sum(counts)
        self.seq = [i for i, count in enumerate(counts) for _ in range(count)]
        self.pos = [start + j for start, count in zip(starts, counts) for j in range(count)]
        self.tables = {key: (cos.reshape(self.total, -1), sin.reshape(self.total, -1))
                       for key, (cos, sin) in rope_tables.items()}


def _weight(linear: GGUFLinear) -> Weight:
    return Weight(linear.blocks.data_ptr(), linear.type_id, linear.out_features)


class FusedBlock:
    """A pre-norm (Llama, Qwen3) or sandwich (Gemma 3) block in one call per forward, for rows of any sequences.

    Projections may mix quant types (Gemma's Q5_0 / Q8_0), so q/k/v and gate/up go in as lists of parts.
    """

    def __init__(self, block: PreNormBlock | SandwichBlock):
        attn, mlp = block.attn, block.mlp
        if isinstance(block, SandwichBlock):
            norms = [block.pre_attn, block.post_attn, block.pre_mlp, block.post_mlp]
        else:
            norms = [block.attn_norm, block.mlp_norm]
        qkv, gate_up = _kernel_parts(attn.qkv), _kernel_parts(mlp.gate_up)
        o, down = _kernel_parts(attn.o_proj)[0], _kernel_parts(mlp.down)[0]
        q_norm = attn.q_norm.scale if attn.q_norm is not None else None
        k_norm = attn.k_norm.scale if attn.k_norm is not None else None
        # what the block's pointers are into (checked by `applies`), held with it
        self.tensors = [n.scale for n in norms] + [t for t in (q_norm, k_norm) if t is not None]
        self.tensors += [p.blocks for p in (*qkv, o, *gate_up, down)]
        self.rope = id(attn.rope)
        self.window = attn.window or 0
        self.block = Block(
            norms=(ctypes.c_void_p * 4)(*(n.scale.data_ptr() for n in norms)), n_norms=len(norms),
            hidden=norms[0].scale.numel(), eps=norms[0].eps,
            q_norm=None if q_norm is None else q_norm.data_ptr(), k_norm=None if k_norm is None else k_norm.data_ptr(),
            qkv=(Weight * 3)(*map(_weight, qkv)), n_qkv=len(qkv), o=_weight(o),
            gate_up=(Weight * 2)(*map(_weight, gate_up)), n_gate_up=len(gate_up), down=_weight(down),
            activation=ACTIVATIONS.index(mlp.activation), rope=0, window=self.window, n_heads=attn.n_heads,
            n_kv_heads=attn.n_kv_heads, scale=attn.scale, residual_scale=1.0, out_scale=1.0, kv_source=-1,
        )  # fmt: skip

    @cached_property
    def stack(self):
        """This block alone as a stack, made on its first call of its own (a model run through a FusedStack never
        makes it)."""
        return block_stack([self], [self.rope])

    @staticmethod
    def applies(block: nn.Module) -> bool:
        if not isinstance(block, PreNormBlock | SandwichBlock):
            return False
        attn, mlp = block.attn, block.mlp
        singles = [_kernel_parts(attn.o_proj), _kernel_parts(mlp.down)]
        plain = [getattr(block, n) for n in ("attn_norm", "mlp_norm", "pre_attn", "pre_mlp") if hasattr(block, n)]
        norms = [getattr(block, n) for n in ("attn_norm", "mlp_norm", "pre_attn", "post_attn", "pre_mlp", "post_mlp")
                 if hasattr(block, n)] + [n for n in (attn.q_norm, attn.k_norm) if n is not None]
        linears = [p for module in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down) for p in _kernel_parts(module) or []]
        return (
            _kernel_parts(attn.qkv) is not None
            and attn.qkv_bias is None
            and not attn.qk_norm_whole
            and block.residual_scale == 1.0
            and all(isinstance(norm, RMSNorm) for norm in plain)
            and all(n.scale.dtype == torch.float32 and n.scale.is_contiguous() for n in norms)  # C reads them
            and all(p.blocks.is_contiguous() for p in linears)
            and _kernel_parts(mlp.gate_up) is not None
            and all(p is not None and len(p) == 1 for p in singles)
            and attn.softcap is None
            and attn.head_dim % 8 == 0
            and mlp.activation in ("silu", "gelu_tanh")
            and (attn.q_norm is None) == (attn.k_norm is None)
        )

    def __call__(self, h: torch.Tensor, rope_tables, caches: list, starts: list[int]) -> torch.Tensor:
        """h [B, T, hidden]: T new tokens for each of the B sequences (caches[i] at positions starts[i]...)."""
        b, t, hidden = h.shape
        return self.run(h.reshape(b * t, hidden), Rows(starts, [t] * b, rope_tables), caches).view(b, t, hidden)

    def run(self, h: torch.Tensor, rows: Rows, caches: list) -> torch.Tensor:
        """h [R, hidden], the rows `rows` describes (rows.counts[i] of them for caches[i], in turn)."""
        cos, sin = rows.tables[self.rope]
        for cache, start, count in zip(caches, rows.starts, rows.counts):
            cache.prepare(start, count)
        out = self.stack.run(h, [cos], [sin], [c.k for c in caches], [c.v for c in caches], [int(caches[0].ring)],
                             rows.seq, rows.pos)
        for cache, start, count in zip(caches, rows.starts, rows.counts):
            cache.commit(start, count)
        return out


class FusedStack:
    """Every block of a model in one C++ call per forward (`runlm::BlockStack`, which keeps each block's weight
    arguments from load on): one dispatch from Python per forward instead of one per block, which is most of a
    small model's decode step outside the kernels. Each block computes exactly what its FusedBlock computes."""

    def __init__(self, blocks: list[FusedBlock], ropes: list[nn.Module]):
        self.rope_ids = [id(rope) for rope in ropes]
        self.native = block_stack(blocks, self.rope_ids)

    def run(self, h: torch.Tensor, rows: Rows, caches: list[list]) -> torch.Tensor:
        """h [R, hidden], the rows `rows` describes; caches[i]: sequence i's caches, one per block."""
        spans = list(zip(caches, rows.starts, rows.counts))
        for layer_caches, start, count in spans:
            for cache in layer_caches:
                cache.prepare(start, count)
        by_block = list(zip(*caches))  # block b's caches of every sequence
        tables = [rows.tables[rope] for rope in self.rope_ids]
        out = self.native.run(
            h, [cos for cos, _ in tables], [sin for _, sin in tables],
            [c.k for block_caches in by_block for c in block_caches],
            [c.v for block_caches in by_block for c in block_caches],
            [int(block_caches[0].ring) for block_caches in by_block], rows.seq, rows.pos,
        )  # fmt: skip
        for layer_caches, start, count in spans:
            for cache in layer_caches:
                cache.commit(start, count)
        return out


def block_stack(blocks: list[FusedBlock], rope_ids: list[int]):
    """A `runlm::BlockStack` of `blocks` (each rotating with the table of its RoPE's place in `rope_ids`)."""
    stack = torch.classes.runlm.BlockStack()
    for fused in blocks:
        block = Block.from_buffer_copy(fused.block)
        block.rope = rope_ids.index(fused.rope)
        stack.add_block(ctypes.addressof(block), fused.tensors)
    return stack


def fuse_blocks(model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Set each block's fused call (and its attention's fused decode attention, for the float32 reference path)
    where the kernels apply: float32 on the CPU with runlm's C++ ops built. Returns how many blocks run fused.

    Every GGUF kernel linear then stays on the kernel for any number of rows (no switch to a float GEMM on
    dequantized weights for long prompts): its rows are computed alike for any row count, which is what keeps a
    token's logits independent of the route (prefill chunk, decode, batch, prompt-cache reuse)."""
    native = dtype == torch.float32 and device.type == "cpu" and kernels.available()
    if native:
        for module in model.modules():
            if isinstance(module, GGUFLinear):
                module.dense_min_rows = kernels.NEVER_DENSE  # route-invariant: the kernel for any row count
    fused = 0
    for block in model.layers:
        block.fused = FusedBlock(block) if native and FusedBlock.applies(block) else None
        fused += block.fused is not None
        attn: Attention = block.attn
        attn.fused_attention = native and attn.window is None and attn.softcap is None and attn.head_dim % 8 == 0
    if isinstance(model.head, DenseLinear):  # a float head (tiny or unusual files) on a fused model
        model.head.row_by_row = fused > 0
    model.fused_stack = fused == len(model.layers)
    stack = model.fused_stack and fused > 0
    model.block_stack = FusedStack([block.fused for block in model.layers], list(model.ropes)) if stack else None
    return fused


__all__ = ["FusedBlock", "FusedStack", "fuse_blocks"]
