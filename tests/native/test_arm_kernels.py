"""ARM: the NEON kernels (plain NEON and the dotprod build) give every weight type's dot products the scalar path's
bits. No ARM machine runs the suite: the check is cross-compiled with Debian's g++-aarch64-linux-gnu and run under
qemu-user (correctness only; ARM speed is unmeasured). CI installs both and sets RUNLM_REQUIRE_ARM=1, so missing
tools fail there instead of skipping."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from runlm.native import build

CHECK = Path(__file__).with_name("arm_kernels_check.cpp")
COMPILER, QEMU, SYSROOT = "aarch64-linux-gnu-g++", "qemu-aarch64", "/usr/aarch64-linux-gnu"


def _tools() -> None:
    missing = [tool for tool in (COMPILER, QEMU) if shutil.which(tool) is None]
    if missing:
        if os.environ.get("RUNLM_REQUIRE_ARM") == "1":
            pytest.fail(f"{', '.join(missing)} not found (apt install g++-aarch64-linux-gnu qemu-user)")
        pytest.skip(f"{', '.join(missing)} not found (apt install g++-aarch64-linux-gnu qemu-user)")


@pytest.fixture(scope="module", params=sorted(set(build.ARM_VARIANTS) - {"scalar"}))
def arm_check(request, tmp_path_factory) -> Path:
    """The check built as runlm builds its `request.param` ARM variant."""
    _tools()
    flags, _ = build.ARM_VARIANTS[request.param]
    binary = tmp_path_factory.mktemp("arm") / f"check-{request.param}"
    subprocess.run([COMPILER, *build.STANDALONE_FLAGS, *build.CFLAGS, *flags, f"-I{build.SOURCE.parent}",
                    str(CHECK), "-o", str(binary)], check=True, capture_output=True, text=True, timeout=600)
    return binary


def run(binary: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([QEMU, "-L", SYSROOT, str(binary), *args], capture_output=True, text=True, timeout=300)


def test_every_type_dots_as_the_scalar_path_does_bit_for_bit(arm_check):
    out = run(arm_check)
    assert out.returncode == 0, out.stdout + out.stderr
    dotprod = "dotprod" in arm_check.name
    assert f"build: neon 1, dotprod {int(dotprod)}" in out.stdout
    assert "260 checks, 0 mismatches" in out.stdout


def test_the_check_sees_a_changed_weight_byte(arm_check):
    out = run(arm_check, "--corrupt")
    assert out.returncode == 1 and " 0 mismatches" not in out.stdout


def test_an_arm_cpu_gets_the_best_variant_it_runs(monkeypatch):
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    assert list(build.variants()) == ["dotprod", "neon", "scalar"]
    assert build.best_variant("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp") == "dotprod"
    assert build.best_variant("fp asimd evtstrm crc32") == "neon"
    assert build.best_variant("") == "scalar"
