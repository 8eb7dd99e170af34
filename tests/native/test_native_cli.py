"""`runlm generate --lean`, run as a user runs it: a subprocess, with PyTorch made unimportable to prove it is not
needed, answering what the PyTorch path (`--torch`) answers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runlm.native.prepare import image_for
from runlm.quant import kernels

PROMPT = "What is the capital of France?"


def runlm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runlm", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_lean_generate_answers_as_the_pytorch_path_without_torch(smollm2_gguf, tmp_path):
    image_for(smollm2_gguf)  # made by a process with PyTorch; the lean process only maps it
    blocker = tmp_path / "blocker"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    lean = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24", "--lean",
                 env={"PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])})
    default = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24", "--torch")
    assert lean.returncode == 0, lean.stderr
    assert default.returncode == 0, default.stderr
    assert lean.stdout == default.stdout and lean.stdout.strip()


def test_lean_generate_refuses_what_it_cannot_run(smollm2_gguf):
    out = runlm("generate", "-m", str(smollm2_gguf), "hi", "--lean", "--dtype", "f32")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == ["runlm: error: --dtype: not with --lean (it runs GGUF text models on "
                                               "the CPU kernels)"]
    missing = runlm("generate", "-m", "/nonexistent/model.gguf", "hi", "--lean")
    assert missing.returncode == 1 and "no such file" in missing.stderr
    assert "Traceback" not in missing.stderr + out.stderr


def test_a_seeded_sampled_reply_is_the_pytorch_paths(smollm2_gguf):
    """Both paths sample with runlm.sampling on the same logits: a seed gives the same tokens, and the truncation
    (top-k, top-p) sees the temperature-1 distribution on both (llama.cpp's order)."""
    sampled = ["--temperature", "1.3", "--top-p", "0.9", "--top-k", "40", "--seed", "3", "--max-tokens", "24"]
    lean = runlm("generate", "-m", str(smollm2_gguf), PROMPT, *sampled, "--lean")
    default = runlm("generate", "-m", str(smollm2_gguf), PROMPT, *sampled, "--torch")
    greedy = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24", "--lean")
    assert lean.returncode == 0, lean.stderr
    assert lean.stdout == default.stdout and lean.stdout.strip() and lean.stdout != greedy.stdout
    bad = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--top-p", "1.5", "--lean")
    assert bad.returncode == 1 and bad.stderr.strip() == "runlm: error: top_p: must be in [0, 1], got 1.5"


def test_lean_chat_answers_each_turn_as_the_pytorch_path(smollm2_gguf):
    """Sampled, seeded: each turn's sampler is seeded afresh on both paths."""
    turns = "Hi, who are you?\nWhat is 2+2?\n"
    flags = ["-m", str(smollm2_gguf), "--max-tokens", "20", "--temperature", "0.8", "--seed", "11"]
    lean = subprocess.run([sys.executable, "-m", "runlm", "chat", "--lean", *flags], input=turns,
                          capture_output=True, text=True, timeout=300)
    default = subprocess.run([sys.executable, "-m", "runlm", "chat", "--torch", *flags], input=turns,
                             capture_output=True, text=True, timeout=300)
    assert lean.returncode == 0, lean.stderr
    assert lean.stdout == default.stdout and lean.stdout.count("> ") == 3
