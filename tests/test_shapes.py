"""Random-weight GGUFs at real shapes (runlm.shapes): the named shapes' numbers, a tiny build of each architecture
loaded and run by runlm, and runlm's logits against llama.cpp's on files quantized by llama.cpp's own quantizer.

The full-size files (0.8-2 GB, minutes to build) are not built here; `runlm bench --shape` builds them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import numpy as np
import pytest
import torch
from reference.llama_cpp_reference import reference_llama

from runlm import load
from runlm.bench import run_bench
from runlm.bench.peers import read_bandwidth_gbs
from runlm.cli.commands import build_parser
from runlm.errors import CatalogError, InvalidInputError
from runlm.formats.gguf import GGUFFile, weights_bytes_per_token
from runlm.runner import as_numpy
from runlm.shapes import SHAPES, Shape, ensure_shape, llama3_rope_factors, llama_ftypes, quantize, shape_path
from runlm.text import Tokenizer

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(
    not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed: it is the quantizer and the reference here"
)
ARCH_SHAPES = ("llama-1b", "qwen3-1.7b", "gemma3-1b", "qwen2.5-1.5b", "phi-4-mini", "gemma3-4b")
TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small town"


def tiny(name: str) -> Shape:
    """The named shape with small dims (its architecture, rope, tying, window and tokenizer unchanged).

    Width 256 so that llama.cpp's K-quants (256-wide blocks) apply, as they do at full size; the vocabulary is
    the tokenizer's own 49,152 (the real shapes pad it to their size). Two layers, or six where the sixth is the
    only one a scaling reaches (Gemma 3 4B's linear RoPE is its global layers')."""
    real = SHAPES[name]
    return dataclasses.replace(real, name=f"{name}-tiny", hidden=256, layers=6 if real.rope_linear else 2, heads=4,
                               kv_heads=min(2, real.kv_heads), head_dim=64, ffn=512, vocab=49152)


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory, smollm2_gguf):
    """Where this module's tiny shapes are cached (the tokenizer comes from the pulled SmolLM2)."""
    return tmp_path_factory.mktemp("shapes")


def test_named_shapes_carry_the_published_parameter_counts():
    assert SHAPES["llama-1b"].parameter_count() == 1_235_814_400  # meta-llama/Llama-3.2-1B
    assert SHAPES["llama-3b"].parameter_count() == 3_212_749_824  # meta-llama/Llama-3.2-3B
    assert SHAPES["gemma3-1b"].parameter_count() == 999_885_952  # google/gemma-3-1b-it
    assert SHAPES["qwen2.5-1.5b"].parameter_count() == 1_543_714_304  # Qwen/Qwen2.5-1.5B-Instruct
    assert SHAPES["phi-4-mini"].parameter_count() == 3_836_021_760  # microsoft/Phi-4-mini-instruct
    qwen = SHAPES["qwen3-1.7b"]
    assert round((qwen.parameter_count() - qwen.vocab * qwen.hidden) / 1e9, 1) == 1.4  # card: 1.4B non-embedding


def test_llama3_rope_factors_match_transformers():
    """The rope_freqs tensor is base / scaled inverse frequencies, scaled the way transformers scales llama3."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = SHAPES["llama-1b"]
    factor, low, high, original = shape.llama3_rope
    config = LlamaConfig(hidden_size=shape.hidden, num_attention_heads=shape.heads, head_dim=shape.head_dim,
                         rope_parameters={"rope_type": "llama3", "rope_theta": shape.rope_theta, "factor": factor,
                                          "low_freq_factor": low, "high_freq_factor": high,
                                          "original_max_position_embeddings": original})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim)
    np.testing.assert_allclose(llama3_rope_factors(shape), (base / scaled.double()).numpy(), rtol=1e-5)


@pytest.mark.parametrize("name", ARCH_SHAPES)
@pytest.mark.parametrize("quant", ["F32", "F16"])
def test_tiny_shape_loads_with_its_numbers_and_generates(shape_dir, name, quant):
    shape = tiny(name)
    path = ensure_shape(shape, quant, progress=False, directory=shape_dir)
    gguf = GGUFFile(path)
    stored = {n: gguf.raw(n) for n in gguf.tensor_names()}
    assert {n: raw.shape for n, raw in stored.items()} == dict(shape.tensors())
    assert {raw.type_name for raw in stored.values() if len(raw.shape) == 2} == {quant}
    loaded = load(path)
    config = loaded.config
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
            config.intermediate_size, config.vocab_size, config.tie_embeddings) == (
        shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn, shape.vocab, True)
    assert config.rope_theta == shape.rope_theta and config.max_position == shape.context
    if name == "gemma3-1b":
        assert config.sliding_window == 512 and config.layer_types == ["sliding_attention", "sliding_attention"]
    if name == "gemma3-4b":
        assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.local_rope_scaling is None
    if name == "phi-4-mini":
        assert config.rope_dims == 96 // 2 and config.rope_scaling["rope_type"] == "longrope"
    assert config.max_position == shape.context
    ids = loaded.tokenizer.encode(TEXT)
    assert loaded.tokenizer.decode(ids) == TEXT  # SmolLM2's real BPE, padded vocabulary and all
    logits = as_numpy(loaded.runner.predict_logits(ids))  # the default runtime's: the native one
    assert logits.shape == (shape.vocab,) and np.isfinite(logits).all() and logits.std() > 0.05
    new = loaded.runner.generate(ids, 8)
    assert len(new) == 8 and all(0 <= t < shape.vocab for t in new)


def test_real_shape_pads_the_vocabulary_as_llama_cpp_converts_it(shape_dir, smollm2_gguf):
    """A tiny model with the real 128,256-token Llama 3 vocabulary: SmolLM2's 49,152 tokens, then [PAD{i}]
    tokens of type UNUSED (5); runlm's tokenizer still encodes text to SmolLM2's ids."""
    shape = dataclasses.replace(tiny("llama-1b"), vocab=SHAPES["llama-1b"].vocab, hidden=64, head_dim=16, ffn=128)
    path = ensure_shape(shape, "F16", progress=False, directory=shape_dir)
    metadata, source = GGUFFile(path).metadata, GGUFFile(smollm2_gguf).metadata
    tokens, types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == 128_256
    assert tokens[:49_152] == source["tokenizer.ggml.tokens"] and types[:49_152] == source["tokenizer.ggml.token_type"]
    assert tokens[49_152] == "[PAD49152]" and tokens[-1] == "[PAD128255]" and set(types[49_152:]) == {5}
    assert metadata["tokenizer.ggml.merges"] == source["tokenizer.ggml.merges"]
    assert Tokenizer.from_gguf(metadata).encode(TEXT) == Tokenizer.from_gguf(source).encode(TEXT)


def test_shapes_are_cached_and_keyed_by_their_numbers(shape_dir):
    shape = tiny("llama-1b")
    path = ensure_shape(shape, "F16", progress=False, directory=shape_dir)
    stamp = path.stat().st_mtime_ns
    assert ensure_shape(shape, "f16", progress=False, directory=shape_dir) == path
    assert path.stat().st_mtime_ns == stamp  # not rebuilt
    assert shape_path(dataclasses.replace(shape, layers=3), "F16", shape_dir) != path
    assert not list(shape_dir.glob("*.partial"))
    with pytest.raises(CatalogError, match="unknown shape"):
        ensure_shape("llama-70b", "F16", directory=shape_dir)
    with pytest.raises(CatalogError, match="Q9_Z"):
        ensure_shape(shape, "Q9_Z", directory=shape_dir)


@needs_llama_cpp
def test_a_quantized_shape_is_made_from_the_cached_float16_file_when_there_is_one(shape_dir, tmp_path):
    """The same file as from a fresh F16 intermediate (one seed), and the cached F16 file stays as it was."""
    shape = dataclasses.replace(tiny("llama-1b"), name="reuse")
    cached = ensure_shape(shape, "F16", progress=False, directory=shape_dir)
    stamp = cached.stat().st_mtime_ns
    reused = ensure_shape(shape, "Q8_0", threads=2, progress=False, directory=shape_dir)
    fresh = ensure_shape(shape, "Q8_0", threads=2, progress=False, directory=tmp_path)
    assert reused.read_bytes() == fresh.read_bytes()
    assert cached.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.name]  # no F16 left where none was cached


def test_bench_takes_a_shape_instead_of_a_model_and_bounds_decode_by_bandwidth(shape_dir):
    args = build_parser().parse_args(["bench", "--shape", "llama-1b", "--quant", "Q8_0", "--threads", "2"])
    assert (args.shape, args.quant, args.model) == ("llama-1b", "Q8_0", None)
    both = build_parser().parse_args(["bench", "--shape", "llama-1b", "-m", "x.gguf"])
    with pytest.raises(InvalidInputError, match="not both"):
        run_bench(both)
    shape = tiny("qwen3-1.7b")
    path = ensure_shape(shape, "F16", progress=False, directory=shape_dir)
    expected = sum(math.prod(dims) * (2 if len(dims) == 2 else 4) for _, dims in shape.tensors())
    assert weights_bytes_per_token(GGUFFile(path)) == expected  # tied: the embedding is read whole, as the output head
    assert 0.5 < read_bandwidth_gbs(1, megabytes=256, budget_s=0.1) < 2000


def _llama_cpp_logits(path, ids: list[int], n_ctx: int = 128) -> np.ndarray:
    llm = reference_llama(path, n_ctx=n_ctx)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


# max |Δlogit| / std(llama.cpp's logits) measured on these tiny shapes, all 19 positions of the prompt (llama /
# qwen3 / gemma3): F16 0.003 / 0.004 / 0.004; Q8_0 0.060 / 0.065 / 0.080; Q4_K_M 0.074 / 0.084 / 0.114 (mean
# |Δ| 4-7x smaller). runlm's float32 path on the dequantized weights differs from llama.cpp by as much, so the gap
# is llama.cpp's rounding of activations to 8 bits inside its quantized dot products, not runlm's kernels.
# Top-1 agrees at 56 of the 57 quantized positions (the other is a near-tie: margin 0.002 on Gemma Q4_K_M).
BOUNDS = {"F16": 0.01, "Q8_0": 0.1, "Q4_K_M": 0.16}


@needs_llama_cpp
@pytest.mark.parametrize("name", ARCH_SHAPES)
@pytest.mark.parametrize("quant", list(BOUNDS))
def test_logits_agree_with_llama_cpp_on_the_same_file(shape_dir, name, quant):
    path = ensure_shape(tiny(name), quant, threads=2, progress=False, directory=shape_dir)
    if quant == "Q4_K_M":
        file = GGUFFile(path)
        assert {"Q4_K", "Q6_K"} <= {file.raw(n).type_name for n in file.tensor_names()}  # llama.cpp's own mix
    loaded = load(path, max_context=128)  # llama.cpp's context below: Phi-4-mini's LongRoPE picks factors by it
    ids = loaded.tokenizer.encode(TEXT)
    ours = as_numpy(loaded.runner.extend(loaded.runner.new_session(), ids, all_positions=True))
    ref = _llama_cpp_logits(path, ids)
    # the bounds are two layers' rounding; it adds up as a random walk in deeper ones (six layers: Q8_0 0.126,
    # Q4_K_M 0.193 on gemma3-4b's shape, 0.114 / 0.161 on gemma3-1b's at six layers)
    bound = BOUNDS[quant] * ref.std() * math.sqrt(tiny(name).layers / 2)
    delta = np.abs(ours - ref)
    assert delta.max() <= bound, f"max |Δ| {delta.max() / ref.std():.3f} of the spread"
    assert delta.mean() <= bound / 4
    top = np.sort(ref, axis=-1)
    clear = top[:, -1] - top[:, -2] > 2 * delta.max()  # positions whose winner no Δ within the bound could flip
    assert (ours.argmax(-1) == ref.argmax(-1))[clear].all()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.85


@needs_llama_cpp
def test_longrope_takes_its_long_factors_past_the_original_context_as_llama_cpp_does(shape_dir):
    """Phi-4-mini's shape (LongRoPE from 4096 to 131072 positions): with a context of at most 4096 both runtimes turn
    by the short factors, with a longer one by the long; the two answers differ past the first position."""
    path = ensure_shape(tiny("phi-4-mini"), "F16", threads=2, progress=False, directory=shape_dir)
    answers = []
    for n_ctx in (4096, 4097):
        loaded = load(path, max_context=n_ctx)
        ids = loaded.tokenizer.encode(TEXT)
        ours = as_numpy(loaded.runner.extend(loaded.runner.new_session(), ids, all_positions=True))
        ref = _llama_cpp_logits(path, ids, n_ctx)
        assert np.abs(ours - ref).max() <= BOUNDS["F16"] * ref.std()
        answers.append(ours)
    short, long = answers
    np.testing.assert_array_equal(short[0], long[0])  # position 0 turns by nothing
    assert np.abs(short[1:] - long[1:]).max() > 5 * BOUNDS["F16"] * short.std()  # so each check tells them apart


@needs_llama_cpp
@pytest.mark.parametrize("name", ["gemma4-31b-6l", "gemma4-26b-a4b-6l"])
def test_gemma4_shapes_are_files_both_runtimes_read_as_gemma4(shape_dir, name):
    """A Gemma 4 shape at small widths (one period of six layers, the 26B's experts too) is what its numbers say, and
    runlm and llama.cpp read it alike: the first position's logits (no attention mixing yet: with unit q / k norm
    weights and unscaled queries, later positions' softmax is an argmax either runtime's rounding may tip)."""
    real = SHAPES[name]
    shape = dataclasses.replace(real, name=f"{name}-tiny", hidden=256, heads=4, kv_heads=2, global_kv_heads=1,
                                head_dim=64, global_head_dim=128, ffn=512, vocab=49152, sliding_window=16,
                                expert_ffn=256 if real.experts else 0, experts=8 if real.experts else 0,
                                experts_used=2 if real.experts else 0)
    path = ensure_shape(shape, "Q8_0", threads=2, progress=False, directory=shape_dir)
    file = GGUFFile(path)
    assert {n: file.raw(n).shape for n in file.tensor_names()} == dict(shape.tensors())
    loaded = load(path)
    config = loaded.config
    assert (config.head_dim, config.sliding_head_dim, config.num_kv_heads, config.sliding_kv_heads) == (128, 64, 1, 2)
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"] and config.num_experts == shape.experts
    ids = loaded.tokenizer.encode(TEXT)
    ours = as_numpy(loaded.runner.extend(loaded.runner.new_session(), ids, all_positions=True))
    ref = _llama_cpp_logits(path, ids)
    assert np.corrcoef(ours[0], ref[0])[0, 1] >= 0.999


@needs_llama_cpp
def test_quantizer_failure_is_a_typed_error_with_llama_cpps_reason(tmp_path):
    """The quantizer's per-tensor log is kept off the terminal; when it fails its last lines name the cause."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 7)
    with pytest.raises(CatalogError, match="could not quantize broken.gguf.*failed to"):
        quantize(broken, tmp_path / "out.gguf", llama_ftypes()["Q8_0"], threads=1)
    assert not (tmp_path / "out.gguf").exists()
