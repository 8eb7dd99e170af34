"""Where the regrouped weights live: transparent huge pages where the kernel has free 2 MiB blocks for them and makes
them fast, 4 KiB pages otherwise (runlm.native.weights.weight_buffer and WeightReader)."""

import platform

import gguf
import numpy as np
import pytest
from reference.bare_weights import bare_weights

from runlm.native import weights


def _vma_field(address: int, field: str) -> str:
    """`field` of /proc/self/smaps for the mapping that holds `address`."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith(field + ":"):
                return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {field} for the mapping at {address:#x}")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as handle:
            return handle.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def _asked_for_huge_pages(array: np.ndarray) -> bool:
    return "hg" in _vma_field(array.ctypes.data, "VmFlags").split()  # MADV_HUGEPAGE on the mapping


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off or absent")
def test_weight_buffers_ask_for_huge_pages_only_where_free_blocks_hold_them(monkeypatch):
    """Decode streams the weights: they go in huge pages where the kernel has free 2 MiB blocks for all of them, and
    in 4 KiB pages where it would have to compact memory to make them (each fault would stall)."""
    monkeypatch.setattr(weights, "free_huge_page_bytes", lambda: 1 << 40)
    roomy, rate = weights.weight_buffer(16, 1 << 20)
    assert _asked_for_huge_pages(roomy) and _vma_field(roomy.ctypes.data, "THPeligible") == "1"
    assert rate is None or rate > 0  # made up front and timed (None: a kernel without MADV_POPULATE_WRITE)
    refused, rate = weights.weight_buffer(16, 1 << 20, huge_pages=False)
    assert not _asked_for_huge_pages(refused) and rate is None
    monkeypatch.setattr(weights, "free_huge_page_bytes", lambda: 8 << 20)  # less than the buffer and the spare
    tight, rate = weights.weight_buffer(16, 1 << 20)
    assert not _asked_for_huge_pages(tight) and rate is None
    if _thp_mode() == "madvise":
        assert _vma_field(tight.ctypes.data, "THPeligible") == "0"
    small, _ = weights.weight_buffer(1, 1 << 20)  # under one huge page: never asked
    assert not _asked_for_huge_pages(small)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off or absent")
def test_huge_pages_made_slowly_are_given_up_after_one_step(monkeypatch):
    """Huge pages are made a step at a time: after a step made below the floor the rest of the weight goes in 4 KiB
    pages (its own mapping's range marked MADV_NOHUGEPAGE), so a slow host costs one step, not the whole weight."""
    monkeypatch.setattr(weights, "free_huge_page_bytes", lambda: 1 << 40)
    step = weights._HUGE_FILL_PROBE
    monkeypatch.setattr(weights, "_HUGE_FILL_FLOOR", float("inf"))  # every step is slow
    slow, rate = weights.weight_buffer(3, step)
    if rate is None:
        pytest.skip("this kernel cannot make pages up front (MADV_POPULATE_WRITE)")
    assert _asked_for_huge_pages(slow) and not _asked_for_huge_pages(slow[1:])
    assert "nh" in _vma_field(slow[1:].ctypes.data, "VmFlags").split()
    assert 0 < rate < float("inf")
    monkeypatch.setattr(weights, "_HUGE_FILL_FLOOR", 0.0)  # every step is fast enough
    fast, rate = weights.weight_buffer(3, step)
    assert all(_asked_for_huge_pages(fast[i:]) for i in range(3)) and rate > 0


@pytest.mark.parametrize("rate, later", [(0.5e9, False), (8e9, True), (None, True)])
def test_a_load_gives_huge_pages_up_where_the_kernel_makes_them_slowly(tmp_path, monkeypatch, rate, later):
    """A VM whose host backs memory only at first touch makes huge pages at ~0.6 GB/s, 1B Q8_0 loading in 2.5 s
    against 0.9 s in small pages: after one slow weight of 8 MB or more the load asks for no more of them."""
    rows, cols = 2048, 8192  # 9.4 MB of Q4_0, which every vector build regroups (Q8_0 some read in place)
    blocks = np.random.default_rng(0).integers(0, 256, (rows, cols // 32 * 18), dtype=np.uint8)
    q4 = (blocks, gguf.GGMLQuantizationType.Q4_0)
    file, reader = bare_weights(tmp_path / "big.gguf", {"a.weight": q4, "b.weight": q4})
    asked = []

    def timed_buffer(rows: int, row_bytes: int, huge_pages: bool = True):
        asked.append(huge_pages)
        return np.zeros((rows, row_bytes), dtype=np.uint8), rate if huge_pages else None

    monkeypatch.setattr(weights, "weight_buffer", timed_buffer)
    for name in ("a.weight", "b.weight"):
        part = reader._linear([file.raw(name)], [None])[0]
        assert part.data.nbytes == file.raw(name).data.nbytes
    assert asked == [True, later]
    assert len(reader.small_pages) == (0 if later and rate else 2)  # the buffers HugePages makes huge later


def _collapse_works() -> bool:
    release = tuple(int(part) for part in platform.release().split(".")[:2] if part.isdigit())
    return platform.system() == "Linux" and release >= (6, 1) and _thp_mode() in ("madvise", "always")


@pytest.mark.skipif(not _collapse_works(), reason="MADV_COLLAPSE needs Linux 6.1 and transparent huge pages")
def test_weights_left_in_small_pages_go_into_huge_pages_in_the_background():
    """A buffer the load filled in 4 KiB pages becomes huge pages with its bytes as they were."""
    buffer, _ = weights.weight_buffer(8, 1 << 20, huge_pages=False)  # 8 MiB: at least three whole huge pages
    buffer[:] = np.random.default_rng(0).integers(0, 256, buffer.shape, dtype=np.uint8)
    before = buffer.copy()
    if _thp_mode() == "madvise":  # (with "always" the kernel may have made huge pages already)
        assert _vma_field(buffer.ctypes.data, "AnonHugePages") == "0 kB"
    promotion = weights.HugePages([buffer])
    assert promotion.wait(timeout=120)
    assert promotion.collapsed_bytes >= 3 << 21 and int(_vma_field(buffer.ctypes.data, "AnonHugePages").split()[0])
    assert np.array_equal(buffer, before)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off or absent")
def test_a_model_whose_load_gave_huge_pages_up_gives_the_same_logits_after_they_are_made(smollm2_gguf, monkeypatch):
    """SmolLM2 loaded as on a host that makes huge pages slowly: its weights go into huge pages after the load, and
    its logits are the same bits before and after."""
    from runlm.native.model import NativeModel

    monkeypatch.setattr(weights, "_HUGE_FILL_FLOOR", float("inf"))
    model = NativeModel.open(smollm2_gguf)
    ids = [1, 504, 3458, 314, 253, 1345, 30]
    before = np.array(model.extend(model.new_session(64), ids, all_positions=True))
    assert model.huge_pages is not None and model.huge_pages.wait(timeout=300)
    if _collapse_works():
        assert model.huge_pages.collapsed_bytes > 0
    assert np.array_equal(np.array(model.extend(model.new_session(64), ids, all_positions=True)), before)
