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
