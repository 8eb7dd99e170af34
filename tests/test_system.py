from __future__ import annotations

import ctypes
import platform

import pytest

from runlm import system
from runlm.system import free_huge_page_bytes, release_free_heap


def rss_anon_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_release_free_heap_returns_freed_small_blocks():
    """Small blocks freed below a live one stay resident (glibc trims only its heap's top by itself) until
    release_free_heap hands their pages back: what loading's tokenizer build and metadata leave behind."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(40_000)]  # ~160 MB below the next block
    keeper = libc.malloc(4096)
    for block in blocks:
        ctypes.memset(block, 1, 4096)
    for block in blocks:
        libc.free(block)
    freed_but_kept = rss_anon_mb()
    release_free_heap()
    released = rss_anon_mb()
    libc.free(keeper)
    assert freed_but_kept - released > 100, (freed_but_kept, released)


def _plant(folder) -> None:
    """Modules a hostile folder might hold: each leaves a mark when imported."""
    for name in ("numpy", "pip", "planted"):
        (folder / f"{name}.py").write_text(f"open({str(folder / 'ran')!r}, 'a').write({name!r})\n")


def test_python_children_never_import_from_the_current_directory(tmp_path, monkeypatch):
    import subprocess

    from runlm.system import python_command

    _plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    run = subprocess.run(python_command("-c", "import numpy, planted"), capture_output=True, text=True)
    assert "No module named 'planted'" in run.stderr
    assert not (tmp_path / "ran").exists()


def test_pulling_from_a_folder_with_a_planted_pip_runs_the_real_pip(tmp_path, monkeypatch):
    from runlm.catalog import _download_wheel
    from runlm.errors import CatalogError

    _plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CatalogError):
        _download_wheel("runlm-test-no-such-package", tmp_path / "wheels", progress=False)
    assert not (tmp_path / "ran").exists()


BUDDYINFO = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32    153    206    134    154    105     89     57     36     20     14    727
Node 0, zone   Normal  15035  19111   6475   4402   8571   8170   3023   2232   1140    434    420
"""


def test_free_huge_page_bytes_counts_free_blocks_of_2_mib_and_more():
    """Orders 9 (2 MiB) and 10 (4 MiB) of every zone; the smaller free blocks could not make a huge page."""
    mib = 1 << 20
    assert free_huge_page_bytes(BUDDYINFO) == (1 + 14 + 434) * 2 * mib + (3 + 727 + 420) * 4 * mib
    assert free_huge_page_bytes("Node 0, zone   Normal  5 5 5 5 5 5 5 5 5\n") == 0  # no order 9 listed
    assert free_huge_page_bytes("") == 0


def test_cpu_family_reads_the_first_cpus_family_number(monkeypatch):
    """The family number picks the decode walk on AMD (build.decode_walk_name: Zen 4 is family 25, Zen 5 26)."""
    cpuinfo = {"vendor_id": "AuthenticAMD", "cpu family": "25", "model": "17"}
    monkeypatch.setattr(system, "_first_block", lambda path: cpuinfo)
    assert system.cpu_family() == 25
    cpuinfo["cpu family"] = "unknown"
    assert system.cpu_family() is None
    del cpuinfo["cpu family"]  # ARM's /proc/cpuinfo names none
    assert system.cpu_family() is None
