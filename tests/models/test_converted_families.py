"""Each family as llama.cpp's converter writes it (reference.converted): runlm's logits against transformers' on the
f32 GGUF and the HF directory, and against llama.cpp's on files llama.cpp quantized, on runlm's default path."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from reference.converted import ARCHITECTURES, FAMILIES, RUNLM_FAMILIES, build, dequantized, transformers_logits
from reference.llama_cpp_reference import TIES, check_greedy_agreement, llama_cpp_greedy

from runlm import load
from runlm.errors import ModelLoadError
from runlm.formats.gguf import GGUFFile
from runlm.runner import as_numpy
from runlm.shapes import llama_ftypes, quantize

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed: it is the quantizer and the reference here",
)
PROMPT = [5, 17, 99, 200, 31, 7, 150, 42, 300, 11, 2, 64, 7, 8, 9, 10, 250, 251, 3, 4]
CONTINUATION = 64


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, build(request.param, directory)


def _logits(path, ids, **options) -> tuple[np.ndarray, str]:
    loaded = load(str(path), **options)
    runner = loaded.runner
    return as_numpy(runner.extend(runner.new_session(), ids, all_positions=True)), loaded.runtime


# families with an option only the native runtime applies: their Hugging Face directories are refused in one line
NATIVE_ONLY = {"mistral3": "attention temperature runs on the native runtime only",
               "gemma4": "Gemma 4 runs from GGUF files only", "gemma4-e2b": "Gemma 4 runs from GGUF files only"}


def test_f32_logits_match_transformers(converted):
    family, gguf = converted
    assert GGUFFile(gguf).architecture == ARCHITECTURES.get(family, family)
    expected = transformers_logits(gguf.parent / "hf", PROMPT)
    for path in (gguf, gguf.parent / "hf"):
        if path.name == "hf" and family in NATIVE_ONLY:
            with pytest.raises(ModelLoadError, match=NATIVE_ONLY[family]):
                load(str(path))
            continue
        ours, _ = _logits(path, PROMPT)
        assert np.abs(ours - expected).max() <= 1e-4, f"{family} {path.name}"


@needs_llama_cpp
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M", "IQ4_XS"])
def test_quantized_agrees_with_llama_cpp(converted, quant):
    family, gguf = converted
    check_against_llama_cpp(family, gguf, quant)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return build("qwen2", tmp_path_factory.mktemp("qwen2-types"))


@needs_llama_cpp
@pytest.mark.parametrize("quant", ["IQ4_NL", "Q2_K", "Q3_K_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q5_K_M", "Q6_K", "F16",
                                   "BF16"])
def test_every_type_agrees_with_llama_cpp(qwen2, quant):
    """The types of the test above on every family, the others on one: each file as llama.cpp quantizes it."""
    check_against_llama_cpp("qwen2", qwen2, quant)


def check_against_llama_cpp(family: str, gguf, quant: str) -> None:
    """`gguf` quantized by llama.cpp to `quant`, run on runlm's default path without a fallback: correlation of the
    prompt's logits with llama.cpp's, greedy agreement over llama.cpp's 64-token greedy continuation, and runlm as
    close as llama.cpp to the file's own weights in float32 (dequantized by the gguf package)."""
    label = f"{family} {quant}"
    path = gguf.with_name(f"{quant}.gguf")
    if not path.is_file():
        quantize(gguf, path, llama_ftypes()[quant], threads=2)
    file = GGUFFile(path)
    assert quant.removesuffix("_M") in {file.raw(name).type_name for name in file.tensor_names()}, label
    reference, continuation = llama_cpp_greedy(path, PROMPT, CONTINUATION)
    notes: list[str] = []
    ours, runtime = _logits(path, PROMPT + continuation, note=notes.append)
    assert runtime == "native" and not notes, label
    correlation = np.corrcoef(ours[: len(PROMPT)].ravel(), reference.ravel())[0, 1]
    assert correlation >= 0.995, f"{label}: correlation {correlation:.4f}"
    check_greedy_agreement(ours[len(PROMPT) - 1 : -1], continuation, TIES[quant], label)
    exact, _ = _logits(dequantized(gguf, path), PROMPT)
    ours_error, llama_error = (rounding_error(logits, exact) for logits in (ours[: len(PROMPT)], reference))
    assert ours_error <= 1.2 * llama_error, f"{label}: {ours_error:.4f} from float32, llama.cpp {llama_error:.4f}"


def rounding_error(logits: np.ndarray, exact: np.ndarray) -> float:
    """How far a runtime's integer arithmetic (8-bit activations) puts its logits from the float32 model's: the
    largest difference at each position over that position's logit spread, averaged over the positions."""
    return float((np.abs(logits - exact).max(-1) / exact.std(-1)).mean())


@pytest.fixture(scope="module")
def gemma4_e2b(tmp_path_factory):
    return build("gemma4-e2b", tmp_path_factory.mktemp("gemma4-e2b"))


def test_gemma4_gguf_is_refused_by_the_pytorch_backend(gemma4_e2b):
    with pytest.raises(ModelLoadError, match="gemma4 runs on the native runtime only"):
        load(str(gemma4_e2b), runtime="torch")


@pytest.mark.parametrize("change, message", [
    ({"attention.head_count_kv": [2, 1, 2]}, "head_count_kv has 3 entries for 6 layers"),
    ({"attention.head_count_kv": [2, 1, 2, 1, 2, 3]}, "head_count_kv differs between layers of one kind"),
    ({"attention.sliding_window_pattern": [True, 1, True, True, True, False]}, "not a list of booleans"),
    ({"attention.shared_kv_layers": 6}, "shared_kv_layers is 6, leaving none of the 6 layers"),
    ({"attention.sliding_window_pattern": [True, True, True, False, False, False]},
     "leaves layer 3 no earlier layer of its kind"),
    ({"feed_forward_length": [512, 512, 512, 1024]}, "gives 4 widths for 6 layers"),
    ({"embedding_length_per_layer_input": 1 << 20}, "embedding_length_per_layer_input is 1048576"),
    ({"attention.value_length_swa": 32}, "value_length_swa is 32, runlm supports only 64"),
])
def test_gemma4_metadata_that_does_not_add_up_is_refused_by_name(change, message, gemma4_e2b):
    """A Gemma 4 file whose per-layer metadata contradicts itself is refused with the key named, before a tensor
    is read."""
    from runlm.families import for_gguf

    gguf = GGUFFile(gemma4_e2b)
    for key, value in change.items():
        gguf.metadata[f"gemma4.{key}"] = value
    with pytest.raises(ModelLoadError, match=message):
        from runlm.families.config import check_config

        check_config(for_gguf("gemma4", gguf.path).config_from_gguf(gguf), str(gguf.path), "gguf", "gemma4")


def test_info_prints_the_options_read_from_the_file(converted, capsys):
    from runlm.cli.commands import main

    family, gguf = converted
    assert main(["info", str(gguf)]) == 0
    fields = dict(line.strip().split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert fields["architecture"].startswith(f"{RUNLM_FAMILIES.get(family, family)}: ")
    expected = {
        "granite": ("scales", "embedding 12, attention 0.015625, residual 0.22, logits 1/ 8"),
        "olmo2": ("architecture", "olmo2: post-norm blocks, q/k norms over the projections, silu MLP"),
        "smollm3": ("rope", "theta 5e+06, none in layers 3"),
        "qwen2-yarn": ("rope", "theta 1e+06, yarn scaling"),
        "phi3": ("rope", "theta 10000, longrope scaling, 48 of 64 values"),
        "qwen2": ("head", "its own"),  # released Qwen2.5 0.5B ties it; this file does not
        "mistral3": ("attention", "full, query temperature 1 + 0.1 log(1 + position // 8)"),
        "gemma4": ("heads (q / kv)", "4 / 1 of 128 (sliding-window layers: 4 / 2 of 64)"),
        "gemma4-e2b": ("attention", "sliding window 8 in 4 of 6 layers, the last 3 layers reusing an earlier "
                                    "layer's keys and values"),
    }
    if family in expected:
        key, value = expected[family]
        assert fields[key] == value


def test_a_bias_runlm_does_not_apply_is_refused(tmp_path):
    """A llama checkpoint with MLP biases: refused with the tensor named, on both runtimes, never run without them."""
    from reference.converted import DIMS, convert
    from reference.tiny import _write_hf_tokenizer, tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    from runlm.errors import ModelLoadError

    model = LlamaForCausalLM(LlamaConfig(**DIMS, mlp_bias=True))
    model.save_pretrained(tmp_path / "hf")
    _write_hf_tokenizer(tmp_path / "hf", tiny_tokenizer())
    gguf = convert(tmp_path / "hf", tmp_path / "model.gguf", "q8_0")
    for path, runtime in ((gguf, "native"), (gguf, "torch"), (tmp_path / "hf", "torch")):
        with pytest.raises(ModelLoadError, match="mlp.gate_proj.bias.*does not apply|ffn_gate.bias"):
            load(str(path), runtime=runtime)


def test_partial_rope_that_splits_a_pair_is_refused(tmp_path):
    from reference.converted import DIMS

    from runlm.errors import ModelLoadError
    from runlm.families import for_hf
    from runlm.families.config import check_config

    config = {**DIMS, "model_type": "qwen2", "partial_rotary_factor": 0.3}  # 19 of 64 values
    with pytest.raises(ModelLoadError, match="19 rotated values per head of 64, expected an even number"):
        check_config(for_hf(config, tmp_path).config_from_hf(config), "config.json", "hf")


@pytest.mark.parametrize("family", ["qwen2-yarn", "phi3"])
def test_an_original_context_left_out_is_read_as_transformers_reads_it(family, tmp_path):
    """YaRN or LongRoPE without the scaling's original context: the top-level one where there is one, else the
    context (logits as transformers' on the same directory)."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    hf = build(family, tmp_path / "built").parent / "hf"
    edited = shutil.copytree(hf, tmp_path / "edited")
    config = json.loads((edited / "config.json").read_text())
    scaling = config.get("rope_parameters") or config["rope_scaling"]
    original = scaling.pop("original_max_position_embeddings", None) or config.get("original_max_position_embeddings")
    if family == "qwen2-yarn":
        config["max_position_embeddings"] = original  # the context now the original one: factor 4 over 64 positions
    (edited / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(edited, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].numpy()
    ours, _ = _logits(edited, PROMPT)
    assert np.abs(ours - expected).max() <= 1e-4
