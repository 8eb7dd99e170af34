"""Mixture-of-experts families on the native runtime, each a tiny random-weight model made with transformers and
converted by llama.cpp's own converter (reference.converted.MOE_FAMILIES): logits against transformers' on the f32
GGUF, against llama.cpp's on files llama.cpp quantized, and the same logits on every route (grouped experts must not
let a row's result depend on the rows beside it)."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import numpy as np
import pytest
import torch
from reference.converted import MOE_FAMILIES, build
from reference.llama_cpp_reference import TIES, check_greedy_agreement, llama_cpp_greedy

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


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def converted(request, tmp_path_factory):
    return request.param, build(request.param, tmp_path_factory.mktemp(request.param))


def _quantized(gguf, quant: str):
    path = gguf.with_name(f"{quant}.gguf")
    if not path.is_file():
        quantize(gguf, path, llama_ftypes()[quant], threads=2)
    return path


def test_f32_logits_match_transformers(converted):
    from transformers import AutoModelForCausalLM

    family, gguf = converted
    assert GGUFFile(gguf).architecture == family
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    loaded = load(str(gguf))
    assert loaded.runtime == "native"
    runner = loaded.runner
    ours = as_numpy(runner.extend(runner.new_session(), PROMPT, all_positions=True))
    assert np.abs(ours - expected).max() <= 1e-4, family


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is the quantizer here")
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_quantized_agrees_with_llama_cpp(converted, quant):
    """Correlation of the prompt's logits, and greedy agreement over llama.cpp's 64-token greedy continuation."""
    family, gguf = converted
    path = _quantized(gguf, quant)
    reference, continuation = llama_cpp_greedy(path, PROMPT, CONTINUATION)
    loaded = load(str(path))
    assert loaded.runtime == "native"
    runner = loaded.runner
    ours = as_numpy(runner.extend(runner.new_session(), PROMPT + continuation, all_positions=True))
    correlation = np.corrcoef(ours[: len(PROMPT)].ravel(), reference.ravel())[0, 1]
    assert correlation >= 0.995, f"{family} {quant}: correlation {correlation:.4f}"
    check_greedy_agreement(ours[len(PROMPT) - 1 : -1], continuation, TIES[quant], f"{family} {quant}")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is the quantizer here")
def test_every_route_gives_the_same_logits(converted):
    """Whole prefill, chunks, single steps and a decode step batched beside another sequence (whose rows pick other
    experts) give bit-identical logits."""
    family, gguf = converted
    runner = load(str(_quantized(gguf, "Q4_K_M"))).runner
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
    assert "mixture of 8 experts of 256, 2 per token (softmax_topk, renormalized)" in out


def test_experts_the_file_cannot_have_are_refused(converted):
    family, gguf = converted
    spec, config = model_config(GGUFFile(gguf))
    for change, message in (({"experts_per_token": 9}, "expert_used_count is 9, more than the 8 experts"),
                            ({"num_experts": 0, "experts_per_token": 0}, "names none"),
                            ({"expert_ffn": 1 << 20}, "expert_feed_forward_length is 1048576")):
        with pytest.raises(ModelLoadError, match=message):
            bad = replace(config, **change)
            check_config(bad, "f.gguf", "gguf", family)
            NativeModel(GGUFFile(gguf), described=(spec, bad))


def test_the_pytorch_backend_refuses_experts_in_one_line(converted):
    family, gguf = converted
    for path in (gguf, gguf.parent / "hf"):
        with pytest.raises(ModelLoadError, match="mixture of experts, which runs on the native runtime only"):
            load(str(path), runtime="torch" if path == gguf else "auto")
