"""The `runlm` command's routing (runlm/launch.py): `generate`, `chat` and `serve` run in a process without PyTorch
unless --torch, a flag only PyTorch takes, or the model says otherwise; a model that cannot run there runs on the
PyTorch path, said once in a line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from reference.tiny import build_llama

from runlm.native.prepare import image_for, image_path, refusal_note
from runlm.quant import kernels

PROMPT = "What is the capital of France?"
BLOCKED = "torch is blocked in this test"


def runlm(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runlm", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory) -> dict[str, str]:
    """The environment of a process in which `import torch` fails."""
    blocker = tmp_path_factory.mktemp("blocker")
    (blocker / "torch").mkdir()
    (blocker / "torch" / "__init__.py").write_text(f"raise ImportError({BLOCKED!r})\n")
    return {"PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_generate_runs_without_torch_unless_asked(smollm2_gguf, without_torch):
    image_for(smollm2_gguf)  # made by a process with PyTorch, which the blocked processes below cannot start
    plain = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "16", env=without_torch)
    torch_path = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "16", "--torch")
    assert plain.returncode == 0, plain.stderr
    assert torch_path.returncode == 0, torch_path.stderr
    assert plain.stdout == torch_path.stdout and plain.stdout.strip()
    # --torch, and flags only the PyTorch path takes, go there (and so fail where torch cannot be imported)
    for flags in (["--torch"], ["--dtype", "f32"], ["--swa-full"], ["--device", "cpu", "--dtype", "bf16"]):
        out = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "4", *flags, env=without_torch)
        assert out.returncode != 0 and BLOCKED in out.stderr, flags
    both = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--lean", "--torch")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_a_model_that_cannot_run_lean_runs_on_pytorch(tmp_path):
    """A float32 GGUF has no fused blocks: the first run finds out (its image is refused), says so in a line and
    answers on the PyTorch path; the next run knows from the note and says the same; --lean is an error."""
    build_llama(tmp_path)
    model = tmp_path / "model.gguf"
    args = ("generate", "-m", str(model), "--raw", "--max-tokens", "6", "Once upon a time")
    first = runlm(*args)
    note = refusal_note(image_path(model))
    assert first.returncode == 0, first.stderr
    assert note.is_file() and not image_path(model).exists()
    written = note.stat().st_mtime_ns
    second, torch_path = runlm(*args), runlm(*args, "--torch")
    assert first.stdout == second.stdout == torch_path.stdout and first.stdout.strip()
    said = [line for line in first.stderr.splitlines() if "running on the PyTorch path" in line]
    assert len(said) == 1 and "cannot run without PyTorch" in said[0] and "fused" in said[0]
    assert said[0] in second.stderr.splitlines() and note.stat().st_mtime_ns == written
    assert "PyTorch path" not in torch_path.stderr
    forced = runlm(*args, "--lean")
    assert forced.returncode == 1 and forced.stderr.strip().splitlines()[-1].startswith("runlm: error:")
    assert "cannot run without PyTorch" in forced.stderr and "Traceback" not in forced.stderr
    note.unlink()


def test_a_directory_model_takes_the_pytorch_path_without_preparing(tmp_path):
    build_llama(tmp_path)
    out = runlm("generate", "-m", str(tmp_path / "hf"), "--raw", "--max-tokens", "4", "Once upon a time")
    assert out.returncode == 0, out.stderr
    assert "preparing" not in out.stderr and out.stdout.strip()
