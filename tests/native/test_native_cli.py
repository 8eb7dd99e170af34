"""`runlm generate` and `chat` on the native runtime, run as a user runs them: a subprocess, with PyTorch made
unimportable to prove it is not needed, answering what the PyTorch backend (`--torch`) answers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runlm.pytorch import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")

PROMPT = "What is the capital of France?"


def runlm(*args: str, env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runlm", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, input=stdin)


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory) -> dict[str, str]:
    """The environment of a process in which `import torch` fails."""
    blocker = tmp_path_factory.mktemp("blocker")
    (blocker / "torch").mkdir()
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    return {"PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}


def test_native_generate_answers_as_the_pytorch_backend_without_torch(smollm2_gguf, without_torch):
    native = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24", "--native", env=without_torch)
    default = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24", "--torch")
    assert native.returncode == 0, native.stderr
    assert default.returncode == 0, default.stderr
    assert native.stdout == default.stdout and native.stdout.strip()


def test_native_generate_refuses_what_it_cannot_run(smollm2_gguf):
    out = runlm("generate", "-m", str(smollm2_gguf), "hi", "--native", "--dtype", "f32")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [f"runlm: error: {smollm2_gguf}: the native runtime cannot take dtype "
                                               f"f32"]
    missing = runlm("generate", "-m", "/nonexistent/model.gguf", "hi", "--native")
    assert missing.returncode == 1 and "no such file" in missing.stderr
    assert "Traceback" not in missing.stderr + out.stderr


def test_a_seeded_sampled_reply_is_the_pytorch_backends(smollm2_gguf):
    """Both runtimes sample with runlm.sampling on the same logits: a seed gives the same tokens."""
    sampled = ["--temperature", "1.3", "--top-p", "0.9", "--top-k", "40", "--seed", "3", "--max-tokens", "24"]
    native = runlm("generate", "-m", str(smollm2_gguf), PROMPT, *sampled)
    default = runlm("generate", "-m", str(smollm2_gguf), PROMPT, *sampled, "--torch")
    greedy = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24")
    assert native.returncode == 0, native.stderr
    assert native.stdout == default.stdout and native.stdout.strip() and native.stdout != greedy.stdout
    bad = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--top-p", "1.5")
    assert bad.returncode == 1 and bad.stderr.strip() == "runlm: error: top_p: must be in [0, 1], got 1.5"


def test_native_chat_answers_each_turn_as_the_pytorch_backend(smollm2_gguf, without_torch):
    """Sampled, seeded: each turn's sampler is seeded afresh on both runtimes."""
    turns = "Hi, who are you?\nWhat is 2+2?\n"
    flags = ["-m", str(smollm2_gguf), "--max-tokens", "20", "--temperature", "0.8", "--seed", "11"]
    native = runlm("chat", *flags, env=without_torch, stdin=turns)
    default = runlm("chat", "--torch", *flags, stdin=turns)
    assert native.returncode == 0, native.stderr
    assert native.stdout == default.stdout and native.stdout.count("> ") == 3
    assert "native" in native.stderr.splitlines()[0]
