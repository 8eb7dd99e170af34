"""Layers shared by every family: norms, RoPE, attention over a KV cache, caches."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runlm.native.build import Q8_0_BYTES, Q8_0_VALUES
from runlm.pytorch import kernels
from runlm.rope import table_block


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; `offset=1.0` gives Gemma's (1 + weight) form."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0):
        super().__init__()
        self.register_buffer("scale", weight.float() + offset, persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and kernels.available():
            return torch.ops.runlm.rms_norm(x, self.scale, self.eps)  # one call instead of six small ops
        return F.rms_norm(x.float(), self.scale.shape, self.scale, self.eps).to(x.dtype)


# -- rotary position embeddings --------------------------------------------------


class Rope(nn.Module):
    """cos/sin tables grown on demand; applied with the rotate-half convention."""

    def __init__(self, inv_freq: torch.Tensor | np.ndarray, scale: float = 1.0):
        """`scale`: YaRN's and LongRoPE's attention factor on cos and sin (runlm.rope.table_block)."""
        super().__init__()
        self.scale = scale
        inv_freq = torch.as_tensor(inv_freq)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos", torch.empty(0, inv_freq.numel() * 2), persistent=False)
        self.register_buffer("sin", torch.empty(0, inv_freq.numel() * 2), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions [T] or [B, T], with a head axis to broadcast over [B, T, H, D]."""
        needed = int(positions.max()) + 1
        while needed > self.cos.shape[0]:
            # Whole blocks of positions, each computed alike (runlm.rope: numpy's cos / sin, the bits runlm.native
            # computes too): a position's value never depends on how large the table was when it was made.
            cos, sin = table_block(self.inv_freq.cpu().numpy(), self.cos.shape[0], self.scale)
            device = self.inv_freq.device
            self.cos = torch.cat([self.cos, torch.from_numpy(cos).to(device)])
            self.sin = torch.cat([self.sin, torch.from_numpy(sin).to(device)])
        return self.cos[positions].unsqueeze(-2).to(dtype), self.sin[positions].unsqueeze(-2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x: [B, T, H, D], tables from Rope.tables."""
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)


# -- KV caches --------------------------------------------------------------------

# A q8_0 cache (element type torch.uint8) holds each head row of D values as D / 32 of GGML's block_q8_0: a float16
# scale and 32 int8 values, 34 bytes (build.Q8_0_VALUES, Q8_0_BYTES). Only runlm's fused C++ blocks read and write
# it (kernels.cpp, KvQ8Block).


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a KV cache buffer: head_dim elements, or a q8_0 row's bytes (dtype torch.uint8)."""
    return head_dim // Q8_0_VALUES * Q8_0_BYTES if dtype == torch.uint8 else head_dim


class FullKVCache:
    """Every position's keys and values (position p in row p), in a buffer of `capacity` positions.

    A session that knows how many positions it will hold (prompt + max_tokens) is made with that capacity and
    never grows; otherwise the buffer doubles when full, into a new buffer that only the live positions are
    copied to (so a growth holds the old buffer and the new one, nothing else). Rows past the length are never
    read, so a buffer is left uninitialized (large ones are then committed page by page as positions arrive).
    """

    ring = False

    def __init__(self, n_kv: int, head_dim: int, dtype: torch.dtype, device: torch.device, capacity: int = 256):
        self.k = torch.empty(1, n_kv, max(1, capacity), kv_row_width(head_dim, dtype), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def prepare(self, start: int, count: int) -> None:
        """Room for `count` positions from `start`, which a fused call then writes."""
        self.reserve(start + count)

    def commit(self, start: int, count: int) -> None:
        """A fused call wrote positions start..start+count-1."""
        self.length = start + count

    def reserve(self, needed: int) -> None:
        capacity = self.k.shape[2]
        if needed <= capacity:
            return
        shape = (*self.k.shape[:2], max(needed, 2 * capacity), self.k.shape[3])
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = old.new_empty(shape)
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)
            del old, grown  # the old buffer goes before the next one grows

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int):
        """Store k/v [1, H, T, D] at positions start..start+T-1; return all keys, values, key positions (in the
        cache's dtype)."""
        end = start + k.shape[2]
        self.reserve(end)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end], None

    def decode_attention(self, qkv, cos, sin, start: int, n_heads: int, n_kv_heads: int, scale: float):
        """One new token: RoPE, cache write and attention in one C++ call; returns [n_heads * head_dim]."""
        self.prepare(start, 1)
        out = torch.ops.runlm.decode_attention(qkv, cos, sin, self.k, self.v, start, n_heads, n_kv_heads, scale)
        self.commit(start, 1)
        return out

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, : self.length].clone(), self.v[:, :, : self.length].clone()

    def restore(self, state: tuple[torch.Tensor, torch.Tensor], length: int) -> bool:
        k, v = state
        if length > k.shape[2]:
            return False
        self.reserve(length)
        self.k[:, :, :length] = k[:, :, :length]
        self.v[:, :, :length] = v[:, :, :length]
        self.length = length
        return True


class SlidingKVCache:
    """A ring of the last `window` positions: memory never grows past the window.

    Position p lives in slot p % window, so which position a slot holds follows from the length alone (the
    newest `window` positions below it): nothing per slot to keep in step with the writes.
    """

    ring = True

    def __init__(self, n_kv: int, head_dim: int, window: int, dtype: torch.dtype, device: torch.device):
        self.window = window
        self.k = torch.zeros(1, n_kv, window, kv_row_width(head_dim, dtype), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.length = 0

    def reset(self) -> None:
        self.length = 0

    def positions(self) -> torch.Tensor:
        """The position each slot holds, -1 for a slot that holds none yet."""
        slots = torch.arange(self.window, device=self.k.device)
        newest = self.length - 1
        held = newest - torch.remainder(newest - slots, self.window)
        return torch.where(held >= 0, held, torch.full_like(held, -1))

    def prepare(self, start: int, count: int) -> None:
        """Nothing to make room for: a fused call writes the ring itself."""

    def commit(self, start: int, count: int) -> None:
        """A fused call wrote positions start..start+count-1 (the ring kept the newest `window`)."""
        self.length = start + count

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int):
        """Attend over the ring's live entries plus the new ones (all in the cache's dtype), then keep the newest
        `window`."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        t = k.shape[2]
        end = start + t
        if t == 1:
            slot = start % self.window
            self.k[:, :, slot] = k[:, :, 0]
            self.v[:, :, slot] = v[:, :, 0]
            self.length = end
            live = min(end, self.window)
            # Decode: every live slot is inside the window (their positions make the mask a no-op).
            return self.k[:, :, :live], self.v[:, :, :live], self.positions()[:live]
        held = self.positions()
        live = held >= 0
        keys = torch.cat([self.k[:, :, live], k], dim=2)
        values = torch.cat([self.v[:, :, live], v], dim=2)
        key_pos = torch.cat([held[live], torch.arange(start, end, device=held.device)])
        keep = min(t, self.window)
        slots = torch.arange(end - keep, end, device=held.device) % self.window
        self.k[:, :, slots] = k[:, :, t - keep :]
        self.v[:, :, slots] = v[:, :, t - keep :]
        self.length = end
        return keys, values, key_pos

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k.clone(), self.v.clone(), torch.tensor(self.length)

    def restore(self, state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], length: int) -> bool:
        """Restore a prefix of `length` tokens; impossible once its positions left the ring (a snapshot longer
        than the window can only be restored whole)."""
        k, v, stored = state
        stored = int(stored)
        if length > stored or (length < stored and stored > self.window):
            return False
        self.k.copy_(k)
        self.v.copy_(v)
        self.length = length
        return True


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    key_pos: torch.Tensor | None,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    image_group: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) attention with GQA; q: [1, Hq, T, D], k/v: [1, Hkv, S, D].

    `key_pos` None means no masking is needed for a single query (every key is
    visible) and keys 0..S-1 in order otherwise. `image_group` (optional, indexed by
    absolute position, -1 for text) also lets a query see every key of its own image
    block, Gemma 3's bidirectional rule; the window still applies on top. Keys and values in another dtype than
    the queries (a float16 cache) are converted to the queries' dtype.
    """
    k, v = k.to(q.dtype), v.to(q.dtype)
    n_rep = q.shape[1] // k.shape[1]
    t, s = q.shape[2], k.shape[2]
    mask = None
    if t > 1 or key_pos is not None or window is not None:
        if key_pos is None:
            key_pos = torch.arange(s, device=q.device)
        allowed = key_pos[None, :] <= q_pos[:, None]
        if image_group is not None:
            q_group, k_group = image_group[q_pos], image_group[key_pos]
            allowed |= (q_group[:, None] == k_group[None, :]) & (q_group[:, None] >= 0)
        if window is not None:
            allowed &= (q_pos[:, None] - key_pos[None, :]) < window
        mask = allowed
    if softcap is not None:
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=n_rep > 1)


# -- blocks -----------------------------------------------------------------------


class Attention(nn.Module):
    """Fused-QKV GQA attention with RoPE, an optional Q/K/V bias, optional q/k norms (per head, or over the whole
    projections with `qk_norm_whole`) and a sliding window."""

    def __init__(
        self,
        qkv: nn.Module,
        o_proj: nn.Module,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: Rope,
        scale: float,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        window: int | None = None,
        softcap: float | None = None,
        qkv_bias: torch.Tensor | None = None,
        qk_norm_whole: bool = False,
    ):
        super().__init__()
        self.qkv, self.o_proj, self.rope = qkv, o_proj, rope
        self.q_norm, self.k_norm, self.qk_norm_whole = q_norm, k_norm, qk_norm_whole
        self.register_buffer("qkv_bias", qkv_bias, persistent=False)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scale, self.window, self.softcap = scale, window, softcap
        # RoPE + cache write + attention in one C++ call for single-token steps (set by models.fused at load).
        self.fused_attention = False

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv, normed q and k, v) for x [B, T, hidden], heads split out."""
        b, t, _ = x.shape
        hq, hkv = self.n_heads, self.n_kv_heads
        qkv = self.qkv(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias.to(qkv.dtype)
        if self.q_norm is not None and self.qk_norm_whole:
            q_width, k_width = hq * self.head_dim, hkv * self.head_dim
            qkv = torch.cat([self.q_norm(qkv[..., :q_width]), self.k_norm(qkv[..., q_width : q_width + k_width]),
                             qkv[..., q_width + k_width :]], dim=-1)
        qkv = qkv.view(b, t, hq + 2 * hkv, self.head_dim)
        qk, v = qkv[:, :, : hq + hkv], qkv[:, :, hq + hkv :]
        if self.q_norm is not None and not self.qk_norm_whole:
            qk = torch.cat([self.q_norm(qk[:, :, :hq]), self.k_norm(qk[:, :, hq:])], dim=2)
            qkv = torch.cat([qk, v], dim=2)
        return qkv, qk, v

    def _split_heads(self, qk: torch.Tensor, v: torch.Tensor, cos, sin):
        qk = apply_rope(qk, cos, sin)  # queries and keys rotated in one go
        hq = self.n_heads
        return qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2), v.transpose(1, 2)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope_tables, cache, start: int, image_group=None
    ) -> torch.Tensor:
        """One sequence: x [1, T, hidden] at positions start..start+T-1 over its layer cache."""
        b, t, _ = x.shape
        qkv, qk, v = self._project(x)
        cos, sin = rope_tables[id(self.rope)]
        if t == 1 and self.fused_attention and image_group is None:
            out = cache.decode_attention(qkv, cos, sin, start, self.n_heads, self.n_kv_heads, self.scale)
            return self.o_proj(out.view(1, 1, -1))
        q, k, v = self._split_heads(qk, v, cos, sin)
        keys, values, key_pos = cache.update(k, v, start)
        out = attention(q, keys, values, positions, key_pos, self.scale, self.window, self.softcap, image_group)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward_batch(self, x: torch.Tensor, positions: torch.Tensor, rope_tables, caches: list, starts: list[int]):
        """B sequences, one new token each (x [B, 1, hidden], positions [B, 1]), each over its own cache."""
        b = x.shape[0]
        qkv, qk, v = self._project(x)
        cos, sin = rope_tables[id(self.rope)]
        if self.fused_attention:
            outs = [
                seq_cache.decode_attention(qkv[i], cos[i], sin[i], start, self.n_heads, self.n_kv_heads, self.scale)
                for i, (seq_cache, start) in enumerate(zip(caches, starts))
            ]
            return self.o_proj(torch.stack(outs).view(b, 1, -1))
        q, k, v = self._split_heads(qk, v, cos, sin)
        outs = []
        for i, (seq_cache, start) in enumerate(zip(caches, starts)):
            keys, values, key_pos = seq_cache.update(k[i : i + 1], v[i : i + 1], start)
            outs.append(attention(q[i : i + 1], keys, values, positions[i], key_pos, self.scale, self.window,
                                  self.softcap))
        return self.o_proj(torch.cat(outs).transpose(1, 2).reshape(b, 1, -1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one projection."""

    def __init__(self, gate_up: nn.Module, down: nn.Module, activation: str = "silu"):
        super().__init__()
        self.gate_up, self.down, self.activation = gate_up, down, activation
        self.act = F.silu if activation == "silu" else lambda x: F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


def _residual(h: torch.Tensor, sublayer: torch.Tensor, scale: float) -> torch.Tensor:
    return h + sublayer if scale == 1.0 else h + sublayer * scale


class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): Llama, Qwen3 and most decoders. `residual_scale` multiplies each
    sublayer's output before it is added (Granite)."""

    def __init__(self, attn_norm: nn.Module, attn: Attention, mlp_norm: nn.Module, mlp: GatedMLP,
                 residual_scale: float = 1.0):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp
        self.residual_scale = residual_scale
        self.fused = None  # the whole block in one call, where models.fused set one

    def forward(self, h, positions, rope_tables, cache, start, image_group=None):
        if self.fused is not None and image_group is None:
            return self.fused(h, rope_tables, [cache], [start])
        h = _residual(h, self.attn(self.attn_norm(h), positions, rope_tables, cache, start, image_group),
                      self.residual_scale)
        return _residual(h, self.mlp(self.mlp_norm(h)), self.residual_scale)

    def forward_batch(self, h, positions, rope_tables, caches, starts):
        if self.fused is not None:
            return self.fused(h, rope_tables, caches, starts)
        h = _residual(h, self.attn.forward_batch(self.attn_norm(h), positions, rope_tables, caches, starts),
                      self.residual_scale)
        return _residual(h, self.mlp(self.mlp_norm(h)), self.residual_scale)


class SandwichBlock(nn.Module):
    """Norms before and after both attention and MLP, as Gemma 2/3 do; with nn.Identity before each, the post-norm
    block of OLMo 2."""

    def __init__(self, norms: list[nn.Module], attn: Attention, mlp: GatedMLP, residual_scale: float = 1.0):
        super().__init__()
        self.pre_attn, self.post_attn, self.pre_mlp, self.post_mlp = norms
        self.attn, self.mlp, self.residual_scale = attn, mlp, residual_scale
        self.fused = None  # the whole block in one call, where models.fused set one

    def forward(self, h, positions, rope_tables, cache, start, image_group=None):
        if self.fused is not None and image_group is None:
            return self.fused(h, rope_tables, [cache], [start])
        attended = self.attn(self.pre_attn(h), positions, rope_tables, cache, start, image_group)
        h = _residual(h, self.post_attn(attended), self.residual_scale)
        return _residual(h, self.post_mlp(self.mlp(self.pre_mlp(h))), self.residual_scale)

    def forward_batch(self, h, positions, rope_tables, caches, starts):
        if self.fused is not None:
            return self.fused(h, rope_tables, caches, starts)
        attended = self.attn.forward_batch(self.pre_attn(h), positions, rope_tables, caches, starts)
        h = _residual(h, self.post_attn(attended), self.residual_scale)
        return _residual(h, self.post_mlp(self.mlp(self.pre_mlp(h))), self.residual_scale)
