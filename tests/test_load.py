"""Loading: auto dispatch, and a clear typed error for every kind of bad path or file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference.tiny import build_gemma3, build_llama

from runlm.errors import InvalidInputError, ModelLoadError, UnsupportedArchitectureError
from runlm.pytorch import kernels
from runlm.pytorch.loading import load


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    build_llama(directory)
    return directory


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load(tmp_path / "nope.gguf")


def test_non_gguf_file_with_gguf_name(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load(fake)


def test_truncated_gguf(tiny_llama, tmp_path):
    data = (tiny_llama / "model.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load(cut)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load(tmp_path)


def test_unknown_hf_architecture_lists_supported(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["model_type"], config["architectures"] = "mamba", ["MambaForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="mamba.*supported: .*llama"):
        load(tmp_path / "hf")


def test_unknown_gguf_architecture(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "rwkv.gguf"), "rwkv6")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError, match="rwkv6"):
        load(tmp_path / "rwkv.gguf")


def test_missing_tensor_is_named(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama / "hf", tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.up_proj.weight"):
        load(tmp_path / "hf")


def test_sharded_safetensors_with_index(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama / "hf", tmp_path / "hf")
    directory = tmp_path / "hf"
    weights = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, directory / shard)
        weight_map.update({k: shard for k in keys})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load(directory).runner.predict_logits([1, 2, 3, 4])
    single = load(tiny_llama / "hf").runner.predict_logits([1, 2, 3, 4])
    np.testing.assert_allclose(sharded, single, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_bad_runner_inputs(tiny_llama, fmt):
    runner = load(tiny_llama / fmt).runner
    with pytest.raises(InvalidInputError, match="empty"):
        runner.predict_logits([])
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        runner.predict_logits([1, runner.vocab_size()])
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        runner.generate([-1], 3)
    with pytest.raises(InvalidInputError, match="n_new"):
        runner.generate([1, 2], -1)
    with pytest.raises(InvalidInputError, match="prefill"):
        type(runner)(runner.model, runner.family()).decode_logits(1)
    runner.prefill_logits([1, 2])
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        runner.decode_logits(10**6)
    assert runner.generate([1, 2], 0) == []


def test_context_overflow(tiny_llama):
    from runlm.errors import ContextOverflowError

    runner = load(tiny_llama / "hf", max_context=16).runner
    with pytest.raises(ContextOverflowError):
        runner.generate(list(range(1, 10)), 10)


def test_loaded_model_carries_tokenizer_and_template(tiny_llama):
    loaded = load(tiny_llama / "model.gguf")
    assert loaded.format == "gguf" and loaded.family == loaded.family_spec.name == "llama32"
    text = loaded.chat_template.render([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    ids = loaded.tokenizer.encode(text, add_bos=False)
    assert loaded.tokenizer.decode(ids) == text


def test_device_option(tiny_llama):
    on_cpu = load(tiny_llama / "hf", device="cpu").runner
    assert on_cpu.device.type == "cpu"
    assert np.array_equal(on_cpu.predict_logits([1, 2, 3]), load(tiny_llama / "hf").runner.predict_logits([1, 2, 3]))
    with pytest.raises(InvalidInputError, match="unknown device"):
        load(tiny_llama / "hf", device="abacus")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidInputError, match="no CUDA GPU"):
            load(tiny_llama / "hf", device="cuda")


def test_kv_type_sets_the_cache_element_type_and_the_bytes_a_session_holds(tiny_llama):
    quantized = tiny_llama / "model-q8_0.gguf"
    cases = [  # (file, load options, the caches' element type)
        (quantized, {}, torch.float16),  # quantized weights on the packed path: f16 by default
        (quantized, {"kv_type": "f32"}, torch.float32),
        (quantized, {"dtype": "f32"}, torch.float32),  # the float32 reference stays float32
        (quantized, {"dtype": "f32", "kv_type": "f16"}, torch.float16),
        (tiny_llama / "model.gguf", {}, torch.float32),  # float weights: exact against transformers
        (tiny_llama / "hf", {}, torch.float32),
    ]
    bytes_of = {}
    for path, options, want in cases:
        runner = load(path, **options).runner
        session = runner.new_session(positions=40)
        held = sum(t.numel() * t.element_size() for layer in session.state for t in (layer.k, layer.v))
        assert {layer.k.dtype for layer in session.state} == {want} and held == runner.kv_bytes(40), (path, options)
        bytes_of[want] = held
    assert bytes_of[torch.float16] * 2 == bytes_of[torch.float32]


def test_bad_kv_type_is_a_typed_error(tiny_llama):
    with pytest.raises(InvalidInputError, match="kv_type must be one of auto, f32, f16, q8_0, got 'q4_0'"):
        load(tiny_llama / "model-q8_0.gguf", kv_type="q4_0")


@pytest.mark.skipif(not kernels.available(), reason="a q8_0 KV cache needs runlm's C++ kernels")
def test_q8_0_kv_cache_holds_34_bytes_for_every_32_values(smollm2_gguf):
    held = {}
    for kv_type in ("f16", "q8_0"):
        runner = load(smollm2_gguf, kv_type=kv_type).runner
        session = runner.new_session(positions=40)
        held[kv_type] = sum(t.numel() * t.element_size() for layer in session.state for t in (layer.k, layer.v))
        assert held[kv_type] == runner.kv_bytes(40), kv_type
    assert held["q8_0"] * 64 == held["f16"] * 34  # a block: a 2-byte scale and 32 bytes for 32 values
    with pytest.raises(InvalidInputError, match="a q8_0 KV cache is read by runlm's CPU kernels only"):
        runner.to_device(torch.device("meta"))
    assert runner.device.type == "cpu"


@pytest.mark.skipif(not kernels.available(), reason="with the kernels off, every q8_0 load is refused for that")
def test_q8_0_kv_cache_is_refused_where_the_fused_kernels_do_not_run(tiny_llama, tmp_path):
    """q8_0 blocks are read and written by the fused C++ blocks alone: anywhere else the load is refused, saying
    why, rather than running torch's attention over bytes it cannot read."""
    build_gemma3(tmp_path, head_dim=32)  # heads q8_0 could hold
    refusals = [
        (tmp_path / "model-q8_0.gguf", {"dtype": "f32"}, "dtype 'f32' runs torch's attention"),
        (tmp_path / "model.gguf", {}, "not every block of this gguf model runs on the fused kernels"),
        (tmp_path / "hf", {}, "not every block of this safetensors model runs on the fused kernels"),
        (tiny_llama / "model-q8_0.gguf", {}, "the head dimension 16 is not a multiple of 32"),
    ]
    for path, options, reason in refusals:
        with pytest.raises(InvalidInputError, match=f"kv_type 'q8_0' cannot be used here: {reason}"):
            load(path, kv_type="q8_0", **options)
    code = f"""
from runlm.pytorch.loading import load
from runlm.errors import InvalidInputError
try:
    load({str(tmp_path / "model-q8_0.gguf")!r}, kv_type="q8_0")
except InvalidInputError as exc:
    print(exc)
"""
    env = {k: v for k, v in os.environ.items() if k != kernels.ENV_VAR}
    switched_off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                                  env=dict(env, **{kernels.ENV_VAR: "0"}))
    assert switched_off.returncode == 0 and not switched_off.stderr, switched_off.stderr
    assert switched_off.stdout.startswith("kv_type 'q8_0' cannot be used here: runlm GGUF kernels unavailable: "
                                          f"RuntimeError: disabled by {kernels.ENV_VAR}=0"), switched_off.stdout


PEAK_GROWTH_WHILE_LOADING = """
import sys, torch
from runlm.pytorch.loading import load
from runlm.formats.gguf import GGUFFile
from runlm.pytorch import kernels
from runlm.text import Tokenizer

def peak() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

torch.set_num_threads(1)
kernels.available()
Tokenizer.from_gguf(GGUFFile(sys.argv[1]).metadata)  # the tokenizer's own peak, before the one measured
before = peak()
load(sys.argv[1]).runner.predict_logits([1, 2, 3])
print(peak() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads the peak RSS (VmHWM) from /proc")
def test_loading_a_gguf_holds_its_weights_once(smollm2_gguf):
    """Loading and running a GGUF raises the peak resident memory by about the file's size: weights are read into
    memory of their own or used from the map, never copied out of the map with the pages it touched kept beside them
    (twice the file, 190 MB for this 94 MB one, before). Measured in a process of its own, unpolluted by other tests."""
    if not kernels.available():
        pytest.skip("runlm's kernels are not built: the load path measured here is theirs")
    result = subprocess.run([sys.executable, "-c", PEAK_GROWTH_WHILE_LOADING, str(smollm2_gguf)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    growth, size = int(result.stdout.split()[-1]), smollm2_gguf.stat().st_size
    assert growth < 1.35 * size, f"peak RSS grew {growth / 2**20:.0f} MB loading a {size / 2**20:.0f} MB file"
