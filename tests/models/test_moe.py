"""Mixture-of-experts families on the native runtime, each a tiny random-weight model made with transformers and
converted by llama.cpp's own converter (reference.converted.MOE_FAMILIES): logits against transformers' on the f32
GGUF, against llama.cpp's on files llama.cpp quantized, and the same logits on every route (grouped experts must not
let a row's result depend on the rows beside it)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from reference.converted import ARCHITECTURES, MOE_FAMILIES, build, transformers_logits
from reference.llama_cpp_reference import llama_cpp_greedy

from runlm import load
from runlm.bench.streams import route_logits
from runlm.errors import ModelLoadError
from runlm.families.config import check_config
from runlm.formats.gguf import GGUFFile
from runlm.native.model import NativeModel, model_config
from runlm.runner import as_numpy
from runlm.shapes import llama_ftypes, quantize

PROMPT = [5, 17, 99, 200, 31, 7, 150, 42, 300, 11, 2, 64, 7, 8, 9, 10, 250, 251, 3, 4]
CONTINUATION = 64


_BUILT: dict[str, Path] = {}


def _built(family: str, tmp_path_factory) -> Path:
    """The family's tiny model's f32 GGUF, converted once for the module."""
    if family not in _BUILT:
        _BUILT[family] = build(family, tmp_path_factory.mktemp(family))
    return _BUILT[family]


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def converted(request, tmp_path_factory):
    return request.param, _built(request.param, tmp_path_factory)


def _quantized(gguf, quant: str):
    path = gguf.with_name(f"{quant}.gguf")
    if not path.is_file():
        quantize(gguf, path, llama_ftypes()[quant], threads=2)
    return path


def test_f32_logits_match_transformers(converted):
    family, gguf = converted
    assert GGUFFile(gguf).architecture == ARCHITECTURES.get(family, family)
    expected = transformers_logits(gguf.parent / "hf", PROMPT)
    loaded = load(str(gguf))
    assert loaded.runtime == "native"
    runner = loaded.runner
    ours = as_numpy(runner.extend(runner.new_session(), PROMPT, all_positions=True))
    assert np.abs(ours - expected).max() <= 1e-4, family


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is the quantizer here")
@pytest.mark.parametrize("family, quant", [(family, quant) for family in sorted(MOE_FAMILIES)
                                           for quant in ("Q8_0", "Q4_K_M")] + [("gpt-oss", "MXFP4_MOE")])
def test_quantized_agrees_with_llama_cpp(family, quant, tmp_path_factory):
    """The prompt's logits position by position, and greedy agreement over llama.cpp's 64-token greedy continuation.
    MXFP4_MOE (llama.cpp's gpt-oss mix: MXFP4 experts, Q8_0 elsewhere) is for the families released with it.

    A router's k-th and (k+1)-th experts for a token are at times within the rounding by which runlm and llama.cpp
    differ (the order of their float sums; the K-quants' activation scales): the two then run that token through
    different experts, and its logits differ wholly (in the tiny random models here, about one position in 20-100).
    So most positions, not all, must agree closely, and most greedy steps."""
    gguf = _built(family, tmp_path_factory)
    path = _quantized(gguf, quant)
    if quant == "MXFP4_MOE":
        assert GGUFFile(path).raw("blk.0.ffn_gate_exps.weight").type_name == "MXFP4"
    reference, continuation = llama_cpp_greedy(path, PROMPT, CONTINUATION)
    loaded = load(str(path))
    assert loaded.runtime == "native"
    runner = loaded.runner
    ours = as_numpy(runner.extend(runner.new_session(), PROMPT + continuation, all_positions=True))
    correlations = np.array([np.corrcoef(ours[i], reference[i])[0, 1] for i in range(len(PROMPT))])
    label = f"{family} {quant}: correlations {np.round(correlations, 4).tolist()}"
    assert np.median(correlations) >= 0.998 and (correlations >= 0.995).mean() >= 0.8, label
    agreement = (ours[len(PROMPT) - 1 : -1].argmax(-1) == np.array(continuation)).mean()
    assert agreement >= 0.9, f"{family} {quant}: greedy agreement {agreement:.3f}"


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is the quantizer here")
def test_every_route_gives_the_same_logits(converted):
    """Whole prefill, chunks, single steps and a decode step batched beside another sequence (whose rows pick other
    experts) give bit-identical logits."""
    family, gguf = converted
    runner = load(str(_quantized(gguf, "MXFP4_MOE" if family == "gpt-oss" else "Q4_K_M"))).runner
    ids = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    got = route_logits(runner, ids, split=17, chunk=6)
    for name in ("stepped", "chunked", "batched"):
        assert np.array_equal(got[name], got["whole"]), f"{family}: {name}"
    assert np.array_equal(got["reuse"], got["fresh"])


def test_info_describes_the_experts(converted, capsys):
    from runlm.cli.commands import main

    family, gguf = converted
    assert main(["info", str(gguf)]) == 0
    out = capsys.readouterr().out
    gating = {"qwen3moe": "softmax_topk, renormalized", "gpt-oss": "topk_softmax", "qwen2moe": "softmax_topk",
              "mixtral": "softmax_topk, renormalized", "gemma4-26b": "softmax_topk, renormalized"}[family]
    assert "swiglu_oai mixture" in out or family != "gpt-oss"
    assert f"mixture of 8 experts of 256, 2 per token ({gating})" in out
    assert ("and a shared expert of 512" in out) == (family == "qwen2moe")


def test_experts_the_file_cannot_have_are_refused(converted):
    family, gguf = converted
    spec, config = model_config(GGUFFile(gguf))
    for change, message in (({"experts_per_token": 9}, "expert_used_count is 9, more than the 8 experts"),
                            ({"num_experts": 0, "experts_per_token": 0},
                             "missing tensor .*ffn_gate.weight|holds a router of experts, but the file's metadata"),
                            ({"expert_ffn": 1 << 20}, "expert_feed_forward_length is 1048576")):
        with pytest.raises(ModelLoadError, match=message):
            bad = replace(config, **change)
            check_config(bad, "f.gguf", "gguf", ARCHITECTURES.get(family, family))
            NativeModel(GGUFFile(gguf), described=(spec, bad))


def test_the_pytorch_backend_refuses_experts_in_one_line(converted):
    family, gguf = converted
    for path in (gguf, gguf.parent / "hf"):
        # (a Mixtral directory's model_type names no family: refused as such)
        with pytest.raises(ModelLoadError, match="mixture of experts, which runs on the native runtime only|"
                                                 "model_type 'mixtral'|Gemma 4 runs from GGUF files only"):
            load(str(path), runtime="torch" if path == gguf else "auto")


def test_mxfp4_dequantizes_as_the_gguf_package_does():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    from runlm.native import library
    from runlm.native.build import KERNEL_TYPES

    values = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32) * 4
    values[0, :32] = 0  # an all-zero block: its exponent is the smallest
    blocks = gguf_quantize(values, GGMLQuantizationType.MXFP4)
    want = dequantize(blocks, GGMLQuantizationType.MXFP4)
    got = library.dequantize_rows(np.ascontiguousarray(blocks), KERNEL_TYPES["MXFP4"], 8, 256, np.arange(8))
    np.testing.assert_array_equal(got, want)
    x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
    product = library.linear(x, np.ascontiguousarray(blocks), KERNEL_TYPES["MXFP4"], 8)
    np.testing.assert_allclose(product, x @ want.T, rtol=0.02, atol=0.05 * np.abs(x @ want.T).max())
