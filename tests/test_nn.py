"""Shared layers: the C++ decode step and norm against the plain PyTorch formulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runlm.pytorch import kernels
from runlm.pytorch.nn import FullKVCache, Rope, apply_rope, attention
from runlm.rope import inv_freq

pytestmark = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 256), (4, 4, 16)])
def test_fused_decode_attention_equals_rope_cache_sdpa(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    rope = Rope(inv_freq(head_dim, 10000.0))
    fused = FullKVCache(kv_heads, head_dim, torch.float32, torch.device("cpu"), capacity=4)
    plain = FullKVCache(kv_heads, head_dim, torch.float32, torch.device("cpu"), capacity=4)
    scale = head_dim**-0.5
    for pos in range(11):  # grows past the initial capacity
        qkv = torch.randn(1, 1, heads + 2 * kv_heads, head_dim, generator=gen)
        cos, sin = rope.tables(torch.tensor([pos]), torch.float32)
        got = fused.decode_attention(qkv, cos, sin, pos, heads, kv_heads, scale)
        qk = apply_rope(qkv[:, :, : heads + kv_heads], cos, sin)
        q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)
        keys, values, key_pos = plain.update(k, qkv[:, :, heads + kv_heads :].transpose(1, 2), pos)
        want = attention(q, keys, values, torch.tensor([pos]), key_pos, scale)
        assert (got - want.reshape(-1)).abs().max().item() <= 1e-5
    assert torch.allclose(fused.k[:, :, :11], plain.k[:, :, :11], atol=1e-6)
    assert torch.equal(fused.v[:, :, :11], plain.v[:, :, :11])


def test_native_rms_norm_equals_torch():
    x = torch.randn(3, 5, 576)[:, :, :320]  # non-contiguous input
    w = torch.randn(320)
    assert (torch.ops.runlm.rms_norm(x, w, 1e-6) - F.rms_norm(x, (320,), w, 1e-6)).abs().max().item() <= 1e-5


def test_decode_attention_rejects_a_position_past_the_cache():
    cache = FullKVCache(2, 16, torch.float32, torch.device("cpu"), capacity=4)
    qkv = torch.randn(6, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.runlm.decode_attention(qkv, torch.ones(16), torch.zeros(16), cache.k, cache.v, 4, 2, 2, 0.25)


def test_full_cache_growth_keeps_live_positions_and_a_sized_cache_never_moves():
    cache = FullKVCache(2, 8, torch.float32, torch.device("cpu"), capacity=3)
    rows = torch.randn(1, 2, 7, 8)
    for pos in range(7):  # grows twice: 3 -> 6 -> 12, each time into a new buffer holding the live rows
        cache.update(rows[:, :, pos : pos + 1], -rows[:, :, pos : pos + 1], pos)
    assert cache.k.shape[2] == 12 and torch.equal(cache.k[:, :, :7], rows) and torch.equal(cache.v[:, :, :7], -rows)
    sized = FullKVCache(2, 8, torch.float32, torch.device("cpu"), capacity=7)
    where = sized.k.data_ptr(), sized.v.data_ptr()
    for pos in range(7):
        sized.update(rows[:, :, pos : pos + 1], rows[:, :, pos : pos + 1], pos)
    assert (sized.k.data_ptr(), sized.v.data_ptr()) == where and torch.equal(sized.k, rows)
