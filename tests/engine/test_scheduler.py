"""The scheduler's thread handling (its batching and queueing are tested on SmolLM2 in test_engine_smollm2.py)."""

from __future__ import annotations


def test_release_openmp_pools_keeps_torch_working():
    """Pausing the OpenMP runtime frees idle pools only: the next parallel op rebuilds them and computes the same."""
    import torch

    from runlm.engine.scheduler import release_openmp_pools

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    expected = a @ b
    assert isinstance(release_openmp_pools(), bool)
    torch.testing.assert_close(a @ b, expected)
