"""The native runtime computes the PyTorch backend's logits bit for bit, from the GGUF file itself.

The reference is the PyTorch runner on its default (packed) path: the same C++ blocks (kernels.cpp block_rows) on
the same RoPE tables (runlm.rope) and weight layouts, so equality is exact (np.array_equal), for prefill in one go
and in PREFILL_CHUNK pieces, and for decode steps; on both real GGUFs (Gemma: sliding-window rings, mixed Q5_0 /
Q8_0 parts, sandwich norms) and the tiny quantized Qwen3 (per-head q / k norms), with f16, f32 and q8_0 KV caches.
A float (unquantized) LM head, as the tiny models have, runs as numpy's GEMV: within 1e-5 of torch's there.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from reference.tiny import build_llama, build_qwen3

from runlm.errors import ContextOverflowError, InvalidInputError, ModelLoadError
from runlm.native import library
from runlm.native.build import FLOAT_KERNEL_TYPES
from runlm.native.model import PREFILL_CHUNK, NativeModel
from runlm.pytorch import kernels
from runlm.pytorch.loading import load as load_with_torch

pytestmark = pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")


def assert_same_logits(path, ids, kv_type="f16"):
    runner = load_with_torch(path, kv_type="auto" if kv_type == "f16" else kv_type).runner
    session = runner.new_session()
    whole = runner.extend(session, ids, all_positions=True)
    steps = [runner.extend(session, [t]) for t in (5, 9, 11)]
    model = NativeModel.open(path, kv_type=kv_type)
    native_session = model.new_session(len(ids) + 3)
    native_whole = model.extend(native_session, ids, all_positions=True)
    native_steps = [model.extend(native_session, [t]) for t in (5, 9, 11)]
    last_only = model.extend(model.new_session(len(ids)), ids)  # the last row alone, chunked as the whole was
    dense_head = model.head.blocks.type_id in FLOAT_KERNEL_TYPES.values()
    for got, want in [(native_whole, whole), *zip(native_steps, steps), (last_only, whole[-1])]:
        if dense_head:  # a float head: runlm's float kernel against torch's GEMV, equal to float rounding
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, want)


def test_smollm2_and_gemma3_past_its_window_give_the_pytorch_backends_logits(smollm2_gguf, gemma3_gguf):
    assert_same_logits(smollm2_gguf, list(range(200, 200 + PREFILL_CHUNK + 44)))  # past one prefill chunk
    window = NativeModel.open(gemma3_gguf).config.sliding_window
    ids = torch.randint(3, 2000, (window + 40,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_same_logits(gemma3_gguf, ids)


def test_a_q8_0_kv_cache(gemma3_gguf):
    ids = torch.randint(3, 2000, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_same_logits(gemma3_gguf, ids, kv_type="q8_0")


def test_tiny_qwen3_with_head_norms(tmp_path):
    build_qwen3(tmp_path)
    ids = torch.randint(3, 384, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_same_logits(tmp_path / "model-q8_0.gguf", ids, kv_type="f32")


def test_the_native_modules_import_no_torch():
    code = ("import sys; from runlm.native import library, loader, model, runner, weights; import runlm.cli; "
            "import runlm.cli.commands, runlm.runtime, runlm.families, runlm.server.app; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sessions_refuse_what_does_not_fit(smollm2_gguf):
    model = NativeModel.open(smollm2_gguf)
    session = model.new_session(8)
    assert model.kv_bytes(8) == sum(k.nbytes + v.nbytes for k, v in zip(session.keys, session.values))
    with pytest.raises(ContextOverflowError):
        model.extend(session, list(range(9)))
    with pytest.raises(InvalidInputError):
        model.extend(session, [model.vocab_size])
    with pytest.raises(InvalidInputError):
        model.extend(session, [])
    with pytest.raises(ContextOverflowError):
        model.new_session(model.context + 1)
    assert session.tokens == []  # nothing half-done
    with pytest.raises(InvalidInputError):
        NativeModel.open(smollm2_gguf, kv_type="int4")


def test_float_weights_run_in_float32_and_other_files_are_refused(tmp_path):
    """A float32 GGUF runs on the float kernels with a float32 cache: the PyTorch backend's float32 logits to
    rounding. A file that is no GGUF is refused by name."""
    build_llama(tmp_path)
    ids = [5, 9, 11, 200, 3, 17, 42]
    model = NativeModel.open(tmp_path / "model.gguf", kv_type="f32")
    assert model.head.blocks.type_id == FLOAT_KERNEL_TYPES["F32"]
    got = model.extend(model.new_session(len(ids)), ids, all_positions=True)
    runner = load_with_torch(tmp_path / "model.gguf").runner
    want = runner.extend(runner.new_session(), ids, all_positions=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        NativeModel.open(tmp_path / "hf" / "config.json")


def test_the_standalone_kernels_report_bad_calls():
    x = np.ones((1, 32), dtype=np.float32)
    with pytest.raises(library.KernelError, match="unsupported GGML type"):
        library.linear(x, np.zeros(34, dtype=np.uint8), 99, 1)
    with pytest.raises(library.KernelError, match="out of range"):
        library.dequantize_rows(np.zeros(34, dtype=np.uint8), 8, 1, 32, np.array([3]))
    block = library.Block(n_norms=3)
    with pytest.raises(library.KernelError, match="two .pre-norm. or four"):
        library.check(library.library().rl_stack_add_block(library.library().rl_stack_new(),
                                                           library.ctypes.byref(block)))
    assert library.isa() == kernels.isa()  # one CPU, one instruction set


def test_a_session_keeps_what_it_can_of_the_next_prompt(smollm2_gguf, gemma3_gguf):
    smol = NativeModel.open(smollm2_gguf)
    session = smol.new_session(64)
    smol.extend(session, [5, 6, 7, 8])
    assert smol.reusable(session, [5, 6, 7, 8, 9]) == 4  # an extension keeps everything
    assert smol.reusable(session, [5, 6, 1, 8]) == 2  # a full cache can be cut back to the common prefix
    gemma = NativeModel.open(gemma3_gguf)
    window = min(block.window for block in gemma.blocks if block.ring)
    session = gemma.new_session(window + 40)
    ids = list(range(10, 10 + window + 8))
    gemma.extend(session, ids)
    assert gemma.reusable(session, [*ids, 3]) == len(ids)
    assert gemma.reusable(session, [*ids[:-2], 3]) == 0  # its rings wrapped: the cut positions' slots are gone
