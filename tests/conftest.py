"""Shared fixtures: the real catalog models (pulled once into the runlm cache)."""

from __future__ import annotations

import os
from pathlib import Path

# Spinning OpenMP threads starve each other when the CPU is shared (server thread, CLI subprocesses).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from runlm.catalog import pull

    return pull("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    from runlm.catalog import pull

    return pull("gemma3-270m", progress=False)


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf):
    """SmolLM2 loaded once for the whole run (engine and server tests share it), on the default (packed) path.

    The packed path is route-invariant (runlm.pytorch.fused): a prompt-cache hit, a fresh prefill, a decode step
    and a batched step give bit-identical logits, so tests compare answers reached by different routes token
    for token on the path users get.
    """
    from runlm import load

    return load(smollm2_gguf)
