"""runlm's GGUF header parser against the gguf package's own reader."""

from __future__ import annotations

import numpy as np
import pytest

from runlm.errors import ModelLoadError
from runlm.formats.gguf import GGUFFile


def reference_value(field):
    from gguf import GGUFValueType

    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def test_matches_gguf_reader_on_smollm2(smollm2_gguf):
    from gguf import GGUFReader

    ours, reference = GGUFFile(smollm2_gguf), GGUFReader(str(smollm2_gguf))
    for name, field in reference.fields.items():
        if name.startswith("GGUF."):
            continue
        want = reference_value(field)
        got = ours.metadata[name]
        if isinstance(want, float):
            assert got == pytest.approx(want), name
        else:
            assert got == want, name
    assert ours.tensor_names() == [t.name for t in reference.tensors]
    for tensor in reference.tensors:
        raw = ours.raw(tensor.name)
        assert raw.type_name == tensor.tensor_type.name
        assert raw.shape == tuple(reversed(tensor.shape.tolist()))
        assert np.asarray(raw.data).tobytes() == np.asarray(tensor.data).tobytes(), tensor.name


def test_corrupt_header(tmp_path, smollm2_gguf):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(smollm2_gguf.read_bytes()[:2000])  # cut inside the vocabulary
    with pytest.raises(ModelLoadError, match="broken.gguf: corrupt or truncated"):
        GGUFFile(broken)


def test_truncated_tensor_data(tmp_path, smollm2_gguf):
    data = smollm2_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated GGUF file"):
        GGUFFile(cut)


def test_string_arrays_read_as_each_string_decodes(tmp_path, smollm2_gguf):
    """Vocabulary strings come out as each one decodes alone: empty ones, bytes that are not UTF-8 at the end of one
    string before the next, and a NUL inside a string (which the joined decode cannot take)."""
    from formats.hostile import ARRAY, STRING, GGUFImage

    plain = [b"", b"a", b"\xe2\x82", b"\xff", "\u2581h\u00e9".encode(), b"", b"\xe2\x82\xac", b"\xf0"]
    image = GGUFImage.read(smollm2_gguf)
    image.set("test.plain", ARRAY, (STRING, plain))
    image.set("test.nul", ARRAY, (STRING, [*plain, b"b\x00c", b"\x00"]))
    image.set("test.none", ARRAY, (STRING, []))
    metadata = GGUFFile(image.write(tmp_path / "strings.gguf")).metadata
    assert metadata["test.plain"] == [item.decode("utf-8", "replace") for item in plain]
    assert metadata["test.nul"] == [item.decode("utf-8", "replace") for item in [*plain, b"b\x00c", b"\x00"]]
    assert metadata["test.none"] == []
    assert metadata["tokenizer.ggml.tokens"][:3] == GGUFFile(smollm2_gguf).metadata["tokenizer.ggml.tokens"][:3]


def test_type_table_matches_the_gguf_package():
    """The types runlm reads are named and sized by its own table (importing gguf for it costs a tenth of a second
    at every load): the same names, block sizes and byte sizes as the gguf package's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from runlm.formats.gguf import _READ_TYPES, _tensor_type

    assert len(_READ_TYPES) >= 15
    for type_id in _READ_TYPES:
        reference = GGMLQuantizationType(type_id)
        assert _tensor_type(type_id) == (reference.name, *GGML_QUANT_SIZES[reference])
    assert _tensor_type(16) == ("IQ2_XXS", *GGML_QUANT_SIZES[GGMLQuantizationType.IQ2_XXS])  # one runlm does not run


def test_string_walk_of_the_kernels_library_and_of_python_agree(tmp_path, smollm2_gguf, monkeypatch):
    """The header's string arrays are walked by the kernels' library where the install built it, else in Python:
    the same metadata from a whole file, the same error from one whose vocabulary runs past its end (a length forged
    past 2^63 among them)."""
    from runlm.native import library

    data = smollm2_gguf.read_bytes()
    at = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4 + 8  # type, item type, count
    forged = tmp_path / "forged.gguf"
    forged.write_bytes(data[:at] + (2**63 + 5).to_bytes(8, "little") + data[at + 8 :])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:at + 50_000])

    def outcomes() -> list[object]:
        found: list[object] = [GGUFFile(smollm2_gguf).metadata]
        for broken in (forged, cut):
            with pytest.raises(ModelLoadError, match="corrupt or truncated") as caught:
                GGUFFile(broken)
            found.append(str(caught.value))
        return found

    assert library.library(build_missing=False) is not None  # the install built it: the first route is the library's
    natively = outcomes()

    def no_library(build_missing: bool = True):
        raise ModelLoadError("no kernels here")

    monkeypatch.setattr(library, "library", no_library)
    assert outcomes() == natively
    assert natively[0]["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _present_pages(address: int, nbytes: int) -> int:
    """How many of the process's pages in [address, address + nbytes) are mapped now (/proc/self/pagemap)."""
    import struct

    page = 4096
    first, last = address // page, (address + nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    return sum(entry >> 63 & 1 for (entry,) in struct.iter_unpack("<Q", entries))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/pagemap"), reason="Linux's /proc only")
def test_released_rows_stay_unmapped_when_their_neighbours_are_read(tmp_path):
    """A weight copied out of the map is released; reading the weights beside it through the same map (those used in
    place) must not map its pages back: a fault maps the page cache's pages around it within its VMA, and the
    released range is a VMA of its own."""
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "three.gguf"), "llama")
    for name in ("before", "copied", "after"):
        writer.add_tensor(name, np.full((64, 256), 1.5, dtype=np.float32))  # 64 KiB each
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(tmp_path / "three.gguf")
    before, copied, after = (file.raw(name) for name in ("before", "copied", "after"))
    assert float(copied.mapped_rows(0, 64).view(np.float32).sum()) == 1.5 * 64 * 256  # read through the map
    copied.release_rows(0, 64)
    inner = (copied.data.ctypes.data + 4095) // 4096 * 4096, 12 * 4096  # pages wholly inside it
    assert _present_pages(*inner) == 0
    for neighbour in (before, after):
        assert float(neighbour.mapped_rows(0, 64).view(np.float32).sum()) == 1.5 * 64 * 256
    assert _present_pages(*inner) == 0
    assert float(copied.mapped_rows(0, 64).view(np.float32).sum()) == 1.5 * 64 * 256  # still readable


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux's /proc only")
def test_the_map_asks_for_huge_pages(smollm2_gguf):
    """The file's map carries MADV_HUGEPAGE (smaps' `hg` flag), so faults on the weights read in place bring the
    file in 2 MiB folios, mapped whole, where its file system has large folios."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this platform")
    file = GGUFFile(smollm2_gguf)
    start = file.raw(file.tensor_names()[0]).data.ctypes.data  # an address inside the map
    flags = None
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(bound, 16) for bound in head.split("-"))
                inside = low <= start < high
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    assert flags is not None, "the map is not in /proc/self/smaps"
    assert "hg" in flags
