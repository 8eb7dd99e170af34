"""How the `runlm` command picks a runtime (runlm.runtime.load): the native one for a GGUF file on a CPU, in a process
that never imports PyTorch, unless --torch, an option only the PyTorch backend takes, or the model says otherwise; a
model the native runtime cannot run runs on the PyTorch backend, said in a line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from reference.converted import convert
from reference.tiny import build_llama

from runlm.pytorch import kernels

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
    plain = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "16", env=without_torch)
    torch_path = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "16", "--torch")
    assert plain.returncode == 0, plain.stderr
    assert torch_path.returncode == 0, torch_path.stderr
    assert plain.stdout == torch_path.stdout and plain.stdout.strip()
    # --torch, and options only the PyTorch backend takes, go there (and so fail, in one line, without torch)
    for flags in (["--torch"], ["--dtype", "f32"], ["--swa-full"], ["--device", "cpu", "--dtype", "bf16"]):
        out = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--max-tokens", "4", *flags, env=without_torch)
        assert out.returncode == 1 and BLOCKED in out.stderr and "runlm[torch]" in out.stderr, flags
        assert "Traceback" not in out.stderr
    both = runlm("generate", "-m", str(smollm2_gguf), PROMPT, "--native", "--torch")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


def _odd_heads_model(directory):
    """A tiny Llama whose heads have 12 values, converted by llama.cpp's converter: the native runtime's attention
    takes multiples of 8, the PyTorch backend any width."""
    from reference.tiny import TINY_DIMS, _randomize, _write_hf_tokenizer, tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY_DIMS, "hidden_size": 48, "head_dim": 12}, num_hidden_layers=2)
    model = LlamaForCausalLM(config).eval()
    _randomize(model, 0)
    model.save_pretrained(str(directory / "hf"), safe_serialization=True)
    _write_hf_tokenizer(directory / "hf", tiny_tokenizer())
    return convert(directory / "hf", directory / "model.gguf")


@pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")
def test_a_model_the_native_runtime_cannot_run_runs_on_pytorch(tmp_path):
    """Heads of 12 values: the run says in a line why the native runtime cannot take the model and answers on the
    PyTorch backend, as --torch does; --native is an error naming the reason. Nothing is written beside the model."""
    model = _odd_heads_model(tmp_path)
    args = ("generate", "-m", str(model), "--raw", "--max-tokens", "6", "Once upon a time")
    before = sorted(tmp_path.rglob("*"))
    first, torch_path = runlm(*args), runlm(*args, "--torch")
    assert first.returncode == 0, first.stderr
    assert first.stdout == torch_path.stdout and first.stdout.strip()
    said = [line for line in first.stderr.splitlines() if "running on the PyTorch backend" in line]
    assert len(said) == 1 and "cannot run on the native runtime" in said[0] and "12 values" in said[0]
    assert "PyTorch backend" not in torch_path.stderr
    forced = runlm(*args, "--native")
    assert forced.returncode == 1 and forced.stderr.strip().splitlines()[-1].startswith("runlm: error:")
    assert "cannot run on the native runtime" in forced.stderr and "Traceback" not in forced.stderr
    assert sorted(tmp_path.rglob("*")) == before


def test_a_directory_model_takes_the_pytorch_backend_quietly(tmp_path):
    build_llama(tmp_path)
    out = runlm("generate", "-m", str(tmp_path / "hf"), "--raw", "--max-tokens", "4", "Once upon a time")
    assert out.returncode == 0, out.stderr
    assert "native" not in out.stderr and out.stdout.strip()


def test_info_system_needs_no_torch(without_torch):
    """`runlm info --system` describes the native runtime's kernels; PyTorch's version is read, not imported."""
    out = runlm("info", "--system", env=without_torch)
    assert out.returncode == 0, out.stderr
    fields = dict(line.strip().split(": ", 1) for line in out.stdout.splitlines())
    assert fields["kernels"] and "torch" in fields and "Traceback" not in out.stderr
