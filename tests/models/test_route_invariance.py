"""On the default (packed) path a token's logits do not depend on the route that reached it.

Prefill in one go, prefill in chunks, one decode step at a time, decode batched with another sequence, and a
prompt-cache restore followed by the suffix all give bit-identical logits (torch.equal, not a tolerance):
every stage of the fused block is computed row by row (runlm.pytorch.fused, kernels.cpp "Route-invariant
blocks"). Checked on the tiny quantized models of each family and on both real GGUFs, past Gemma's window,
with the default float16 KV cache (a new key is rounded before any route reads it), with `kv_type="f32"` and with
`kv_type="q8_0"` (a new key is quantized before any route reads it).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference.tiny import GEMMA_WINDOW, QUANTIZED_COPIES, build_gemma3, build_llama, build_qwen3

from runlm.bench.streams import route_logits
from runlm.pytorch import kernels
from runlm.pytorch.loading import load

BUILDERS = {"llama32": build_llama, "qwen3": build_qwen3, "gemma": build_gemma3}


def assert_identical(got: dict) -> None:
    for name in ("stepped", "chunked", "batched"):
        assert np.array_equal(got[name], got["whole"]), name
    assert got["reused"] == len(got["whole"])  # the prompt cache really reused the whole snapshot
    assert np.array_equal(got["reuse"], got["fresh"])


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_tiny_quantized_models_of_every_family(family, tmp_path):
    BUILDERS[family](tmp_path)
    ids = torch.randint(3, 384, (3 * GEMMA_WINDOW + 4,), generator=torch.Generator().manual_seed(4)).tolist()
    for quant in QUANTIZED_COPIES:
        runner = load(tmp_path / f"model-{quant.lower()}.gguf").runner
        assert runner.fused_blocks == len(runner.model.layers)  # every block on the route-invariant fused call
        assert runner.kv_dtype == torch.float16
        assert_identical(route_logits(runner, ids, split=GEMMA_WINDOW + 1, chunk=5))


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_float32_kv_cache(tmp_path):
    build_gemma3(tmp_path)  # a sliding-window ring beside full caches
    ids = torch.randint(3, 384, (2 * GEMMA_WINDOW + 3,), generator=torch.Generator().manual_seed(5)).tolist()
    path = tmp_path / "model-q8_0.gguf"
    runner = load(path, kv_type="f32").runner
    assert {layer.k.dtype for layer in runner.new_session().state} == {torch.float32}
    got = route_logits(runner, ids, split=GEMMA_WINDOW + 1, chunk=7)
    assert_identical(got)
    assert not np.array_equal(got["whole"], route_logits(load(path).runner, ids, GEMMA_WINDOW + 1, 7)["whole"])


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_real_smollm2(smollm2_loaded):
    ids = smollm2_loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)[:100]
    assert_identical(route_logits(smollm2_loaded.runner, ids, split=40, chunk=17))


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_real_gemma3_past_its_sliding_window(gemma3_gguf):
    loaded = load(gemma3_gguf)
    assert loaded.config.sliding_window == 512
    # 640 rows in one call, past the window: the fused attention works through them in two row blocks (its scratch
    # bound: 4M floats hold ~400 rows of 10 key chunks of 4 heads of 256)
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 100)[:640]
    assert_identical(route_logits(loaded.runner, ids, split=610, chunk=130))


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_q8_0_kv_cache_on_a_tiny_gemma3(tmp_path):
    build_gemma3(tmp_path, head_dim=32)  # 32-wide heads: one q8_0 block per head row; a ring beside full caches
    ids = torch.randint(3, 384, (2 * GEMMA_WINDOW + 3,), generator=torch.Generator().manual_seed(6)).tolist()
    runner = load(tmp_path / "model-q4_0.gguf", kv_type="q8_0").runner
    assert {(layer.k.dtype, layer.k.shape[-1]) for layer in runner.new_session().state} == {(torch.uint8, 34)}
    assert_identical(route_logits(runner, ids, split=GEMMA_WINDOW + 1, chunk=7))


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_q8_0_kv_cache_on_real_smollm2(smollm2_gguf):
    loaded = load(smollm2_gguf, kv_type="q8_0")
    runner = loaded.runner
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)[:100]
    assert_identical(route_logits(runner, ids, split=40, chunk=17))
    # The caches of one call are all of one kind: the kernel refuses a q8_0 session batched with a float16 one
    # (sessions of two runners: a runner's own sessions share its kv_dtype).
    other = load(smollm2_gguf).runner
    quantized, half = runner.new_session(), other.new_session()
    runner.prefill(quantized, ids[:3])
    other.prefill(half, ids[:3])
    with pytest.raises(RuntimeError, match="as every other cache of the call"):
        runner.decode_batch([quantized, half], [ids[3], ids[3]])


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_a_long_prefill_runs_in_chunks_with_the_same_logits(smollm2_gguf, monkeypatch):
    """The PyTorch backend's chunking (the native runtime's: tests/native)."""
    from runlm.pytorch import base

    loaded = load(smollm2_gguf)
    runner = loaded.runner
    text = "Pack my box with five dozen liquor jugs. " * 60
    ids = loaded.tokenizer.encode(text)[: 2 * base.PREFILL_CHUNK + 9]
    whole = runner.extend(runner.new_session(), ids, all_positions=True)[-1]  # one pass over every position
    calls: list[int] = []  # rows of each model call
    model_call = type(runner.model).__call__
    monkeypatch.setattr(type(runner.model), "__call__", lambda m, ids_, *a, **k: calls.append(len(ids_)) or
                        model_call(m, ids_, *a, **k))
    assert np.array_equal(runner.prefill(runner.new_session(), ids), whole)
    assert calls == [base.PREFILL_CHUNK, base.PREFILL_CHUNK, 9]


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_one_call_for_all_blocks_gives_the_per_block_calls_logits(family, tmp_path):
    """The whole stack in one native call (FusedStack) computes what one call per block computes: every route,
    batches of sequences (their caches passed block by block) and Gemma's ring caches included."""
    BUILDERS[family](tmp_path)
    runner = load(tmp_path / f"model-{QUANTIZED_COPIES[0].lower()}.gguf").runner
    assert runner.model.block_stack is not None
    ids = torch.randint(3, 384, (GEMMA_WINDOW + 40,), generator=torch.Generator().manual_seed(6)).tolist()
    stacked = route_logits(runner, ids, split=GEMMA_WINDOW - 3, chunk=9)
    runner.model.block_stack = None  # back to one call per block
    per_block = route_logits(runner, ids, split=GEMMA_WINDOW - 3, chunk=9)
    for name, logits in stacked.items():
        assert np.array_equal(logits, per_block[name]), name
