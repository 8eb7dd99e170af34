"""On the default (packed) path a token's logits do not depend on the route that reached it.

Prefill in one go, prefill in chunks, one decode step at a time, decode batched with another sequence, and a
prompt-cache restore followed by the suffix all give bit-identical logits (torch.equal, not a tolerance):
every stage of the fused block is computed row by row (runlm.models.fused, kernels.cpp "Route-invariant
blocks"). Checked on the tiny quantized models of each family and on both real GGUFs, past Gemma's window.
"""

from __future__ import annotations

import pytest
import torch
from reference.tiny import GEMMA_WINDOW, QUANTIZED_COPIES, build_gemma3, build_llama, build_qwen3

from runlm import load
from runlm.quant import kernels

BUILDERS = {"llama32": build_llama, "qwen3": build_qwen3, "gemma": build_gemma3}


def routes(runner, ids: list[int], split: int, chunk: int) -> dict[str, torch.Tensor]:
    """Logits of every position of `ids` reached five ways."""
    whole = runner.extend(runner.new_session(), ids, all_positions=True)
    stepped_session = runner.new_session()
    stepped = [runner.extend(stepped_session, ids[:split], all_positions=True)]
    stepped += [runner.decode(stepped_session, t)[None] for t in ids[split:]]
    chunk_session = runner.new_session()
    chunked = [runner.extend(chunk_session, ids[i : i + chunk], all_positions=True) for i in range(0, len(ids), chunk)]
    batch_session, other = runner.new_session(), runner.new_session()
    runner.prefill(batch_session, ids[:split])
    runner.prefill(other, list(reversed(ids[:5])))
    batched = [whole[:split]]
    for i, token in enumerate(ids[split:]):
        batched.append(runner.decode_batch([other, batch_session], [ids[i % 7], token])[1:2])
    snap = runner.export(chunk_session)
    reused_session = runner.new_session()
    last, reused = runner.prefill_reusing(reused_session, ids + [7], snap, len(ids))
    assert reused == len(ids)
    fresh_last = runner.prefill(runner.new_session(), ids + [7])
    return {"whole": whole, "stepped": torch.cat(stepped), "chunked": torch.cat(chunked),
            "batched": torch.cat(batched), "reuse": last[None], "fresh": fresh_last[None]}


def assert_identical(got: dict[str, torch.Tensor]) -> None:
    for name in ("stepped", "chunked", "batched"):
        assert torch.equal(got[name], got["whole"]), name
    assert torch.equal(got["reuse"], got["fresh"])


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_tiny_quantized_models_of_every_family(family, tmp_path):
    BUILDERS[family](tmp_path)
    ids = torch.randint(3, 384, (3 * GEMMA_WINDOW + 4,), generator=torch.Generator().manual_seed(4)).tolist()
    for quant in QUANTIZED_COPIES:
        runner = load(tmp_path / f"model-{quant.lower()}.gguf").runner
        assert runner.fused_blocks == len(runner.model.layers)  # every block on the route-invariant fused call
        assert_identical(routes(runner, ids, split=GEMMA_WINDOW + 1, chunk=5))


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_real_smollm2(smollm2_loaded):
    ids = smollm2_loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 12)[:100]
    assert_identical(routes(smollm2_loaded.runner, ids, split=40, chunk=17))


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_real_gemma3_past_its_sliding_window(gemma3_gguf):
    loaded = load(gemma3_gguf)
    assert loaded.config.sliding_window == 512
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 80)[:540]
    assert_identical(routes(loaded.runner, ids, split=500, chunk=130))
