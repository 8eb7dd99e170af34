"""Shared fixtures: the real catalog models (pulled once into the runlm cache)."""

from __future__ import annotations

from pathlib import Path

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
