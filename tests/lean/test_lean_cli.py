"""`runlm generate --lean`, run as a user runs it: a subprocess, with PyTorch made unimportable to prove it is not
needed, answering what the default path answers."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from runlm.lean.cli import Sampler
from runlm.lean.prepare import image_for
from runlm.quant import kernels

PROMPT = "What is the capital of France?"


def runlm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runlm", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_lean_generate_answers_as_the_default_path_without_torch(smollm2_gguf, tmp_path):
    image_for(smollm2_gguf)  # made by a process with PyTorch; the lean process only maps it
    blocker = tmp_path / "blocker"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    lean = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24", "--lean",
                 env={"PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])})
    default = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "24")
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


def test_the_sampler():
    logits = np.array([0.0, 3.0, 1.0, 2.9], dtype=np.float32)
    assert Sampler(0.0, 0, 1.0, None)(logits) == 1
    assert {Sampler(1.0, 1, 1.0, seed)(logits) for seed in range(20)} == {1}  # top-k 1 is greedy
    assert {Sampler(1.0, 0, 0.3, seed)(logits) for seed in range(20)} == {1}  # the nucleus holds the top token only
    both = {Sampler(1.0, 2, 1.0, seed)(logits) for seed in range(40)}
    assert both == {1, 3}
    draws = [Sampler(0.8, 0, 0.95, 7)(logits) for _ in range(3)]
    assert len(set(draws)) == 1  # one seed, one draw
    with pytest.raises(Exception, match="top_p"):
        Sampler(1.0, 0, 0.0, None)


def test_lean_chat_answers_each_turn_as_the_default_path(smollm2_gguf):
    turns = "Hi, who are you?\nWhat is 2+2?\n"
    lean = subprocess.run([sys.executable, "-m", "runlm", "chat", "--lean", "-m", str(smollm2_gguf), "--max-tokens",
                           "20"], input=turns, capture_output=True, text=True, timeout=300)
    default = subprocess.run([sys.executable, "-m", "runlm", "chat", "-m", str(smollm2_gguf), "--max-tokens", "20"],
                             input=turns, capture_output=True, text=True, timeout=300)
    assert lean.returncode == 0, lean.stderr
    assert lean.stdout == default.stdout and lean.stdout.count("> ") == 3
