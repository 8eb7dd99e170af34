"""runlm.native computes the default path's logits bit for bit, without PyTorch in its process.

The reference is the PyTorch runner on the default (packed) path: the same C++ blocks (kernels.cpp block_rows) on
the same RoPE tables (runlm.rope), so equality is exact (np.array_equal), for prefill in one go and in
PREFILL_CHUNK pieces, and for decode steps; on both real GGUFs (Gemma: sliding-window rings, mixed Q5_0 / Q8_0
parts, sandwich norms) and the tiny quantized Qwen3 (per-head q / k norms), with f16, f32 and q8_0 KV caches.
A float (unquantized) LM head, as the tiny models have, runs as numpy's GEMV: within 1e-5 of torch's there.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference.tiny import build_qwen3

from runlm import load
from runlm.errors import ContextOverflowError, InvalidInputError, ModelLoadError
from runlm.native import image, native
from runlm.native.model import PREFILL_CHUNK, LeanModel
from runlm.native.prepare import image_for
from runlm.quant import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")


def assert_same_logits(path, image_path, ids, kv_type="f16"):
    runner = load(path, kv_type="auto" if kv_type == "f16" else kv_type).runner
    session = runner.new_session()
    whole = runner.extend(session, ids, all_positions=True).numpy()
    steps = [runner.extend(session, [t]).numpy() for t in (5, 9, 11)]
    model = LeanModel.open(image_path, kv_type=kv_type)
    lean_session = model.new_session(len(ids) + 3)
    lean_whole = model.extend(lean_session, ids, all_positions=True)
    lean_steps = [model.extend(lean_session, [t]) for t in (5, 9, 11)]
    last_only = model.extend(model.new_session(len(ids)), ids)  # the last row alone, chunked as the whole was
    dense_head = model.header["head"]["kind"] == "dense"
    for got, want in [(lean_whole, whole), *zip(lean_steps, steps), (last_only, whole[-1])]:
        if dense_head:  # a float head: numpy's GEMV against torch's, equal to float rounding
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(got, want)


def test_smollm2_and_gemma3_past_its_window_give_the_default_paths_logits(smollm2_gguf, gemma3_gguf, tmp_path):
    ids = list(range(200, 200 + PREFILL_CHUNK + 44))  # past one prefill chunk
    assert_same_logits(smollm2_gguf, image_for(smollm2_gguf, target=tmp_path / "smol.lean"), ids)
    window = load(gemma3_gguf).config.sliding_window
    ids = torch.randint(3, 2000, (window + 40,), generator=torch.Generator().manual_seed(3)).tolist()
    assert_same_logits(gemma3_gguf, image_for(gemma3_gguf, target=tmp_path / "gemma.lean"), ids)


def test_a_q8_0_kv_cache(gemma3_gguf, tmp_path):
    ids = torch.randint(3, 2000, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_same_logits(gemma3_gguf, image_for(gemma3_gguf, target=tmp_path / "gemma.lean"), ids, kv_type="q8_0")


def test_tiny_qwen3_with_head_norms(tmp_path):
    build_qwen3(tmp_path)
    path = tmp_path / "model-q8_0.gguf"
    ids = torch.randint(3, 384, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_same_logits(path, image_for(path, target=tmp_path / "qwen3.lean"), ids, kv_type="f32")


def test_the_lean_modules_import_no_torch():
    code = ("import sys; from runlm.native import cli, engine, image, native, prepare, runner; import runlm.launch; "
            "import runlm.server.app; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_sessions_refuse_what_does_not_fit(smollm2_gguf, tmp_path):
    model = LeanModel.open(image_for(smollm2_gguf, target=tmp_path / "smol.lean"))
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
        LeanModel.open(tmp_path / "smol.lean", kv_type="int4")


def test_not_an_image_and_models_that_cannot_run_lean(smollm2_gguf, tmp_path):
    with pytest.raises(ModelLoadError, match="not a runlm lean image"):
        image.read(smollm2_gguf)
    reference = load(smollm2_gguf, dtype="f32")  # the float32 reference path has no fused blocks
    assert "fused" in image.refusal(reference)
    with pytest.raises(ModelLoadError, match="cannot run without PyTorch"):
        image.write(reference, tmp_path / "no.lean")
    with pytest.raises(ModelLoadError, match="not a file"):
        image_for(tmp_path)


def test_the_standalone_kernels_report_bad_calls():
    x = np.ones((1, 32), dtype=np.float32)
    with pytest.raises(native.KernelError, match="unsupported GGML type"):
        native.linear(x, np.zeros(34, dtype=np.uint8), 99, 1)
    with pytest.raises(native.KernelError, match="out of range"):
        native.dequantize_rows(np.zeros(34, dtype=np.uint8), 8, 1, 32, np.array([3]))
    assert native.isa() == kernels.isa()  # one CPU, one instruction set


def test_images_are_cached_per_file_version_and_replaced(smollm2_gguf, tmp_path, monkeypatch):
    from runlm.native import prepare

    monkeypatch.setattr(prepare, "_images", lambda: tmp_path / "images")
    model = tmp_path / "model.gguf"
    model.write_bytes(smollm2_gguf.read_bytes())
    first = image_for(model)
    assert first == prepare.image_path(model) and first.parent == tmp_path / "images"
    assert image_for(model).stat().st_mtime_ns == first.stat().st_mtime_ns  # found, not made again
    # images of a model file that is gone go when the next image is made; those of one still there stay
    orphan, kept = tmp_path / "images" / "gone-0.lean", tmp_path / "images" / "other-0.lean"
    image._write_file(orphan, {"version": image.VERSION, "source": {"path": str(tmp_path / "gone.gguf")}}, [])
    image._write_file(kept, {"version": image.VERSION, "source": {"path": str(smollm2_gguf)}}, [])
    os.utime(model, ns=(model.stat().st_atime_ns, model.stat().st_mtime_ns + 10**9))  # the file changed
    second = image_for(model)
    assert second != first and second.is_file() and not first.exists()  # the stale image is gone
    assert sorted(p.name for p in (tmp_path / "images").iterdir()) == sorted([second.name, kept.name])


def test_a_session_keeps_what_it_can_of_the_next_prompt(smollm2_gguf, gemma3_gguf, tmp_path):
    smol = LeanModel.open(image_for(smollm2_gguf, target=tmp_path / "smol.lean"))
    session = smol.new_session(64)
    smol.extend(session, [5, 6, 7, 8])
    assert smol.reusable(session, [5, 6, 7, 8, 9]) == 4  # an extension keeps everything
    assert smol.reusable(session, [5, 6, 1, 8]) == 2  # a full cache can be cut back to the common prefix
    gemma = LeanModel.open(image_for(gemma3_gguf, target=tmp_path / "gemma.lean"))
    window = min(block["window"] for block in gemma.header["blocks"] if block["ring"])
    session = gemma.new_session(window + 40)
    ids = list(range(10, 10 + window + 8))
    gemma.extend(session, ids)
    assert gemma.reusable(session, [*ids, 3]) == len(ids)
    assert gemma.reusable(session, [*ids[:-2], 3]) == 0  # its rings wrapped: the cut positions' slots are gone
