"""Split GGUFs (llama.cpp's gguf-split: <prefix>-00001-of-0000N.gguf) are joined on load: a tiny model split by
llama.cpp's own converter (--split-max-tensors) gives the unsplit file's logits bit for bit, opened by any part;
a missing, misnumbered or overlapping part is a one-line error; a split quantization is pulled from the Hub whole."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from reference.converted import build, convert

from runlm import load
from runlm.errors import ModelLoadError
from runlm.formats.gguf import GGUFFile, split_parts

IDS = [1, 5, 9, 33, 100, 7, 250, 3, 44, 60]


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("split")
    build("qwen2", directory)
    whole = convert(directory / "hf", directory / "whole-q8_0.gguf", "q8_0")
    (directory / "parts").mkdir()
    convert(directory / "hf", directory / "parts" / "model-q8_0.gguf", "q8_0", "--split-max-tensors", "12")
    parts = sorted((directory / "parts").glob("*.gguf"))
    assert len(parts) >= 3 and parts[0].name.endswith(f"-00001-of-{len(parts):05d}.gguf"), parts
    return whole, parts


def logits(path) -> np.ndarray:
    runner = load(path).runner
    return runner.extend(runner.new_session(), IDS, all_positions=True)


def test_a_split_model_gives_the_whole_files_logits_opened_by_any_part(split_model):
    whole, parts = split_model
    joined = GGUFFile(parts[1])
    assert joined.path == parts[0] and joined.paths == parts
    assert sorted(joined.tensor_names()) == sorted(GGUFFile(whole).tensor_names())
    assert load(parts[0]).runtime == "native"
    want = logits(whole)
    assert np.array_equal(logits(parts[0]), want)
    assert np.array_equal(logits(parts[-1]), want)
    assert split_parts(parts[0]) == parts


def test_a_missing_part_is_one_line(split_model, tmp_path):
    _, parts = split_model
    for part in parts[:-1]:
        shutil.copy(part, tmp_path / part.name)
    with pytest.raises(ModelLoadError, match="no such model file") as caught:
        GGUFFile(tmp_path / parts[0].name)
    assert parts[-1].name in str(caught.value) and "\n" not in str(caught.value)


def test_a_part_renamed_out_of_place_is_refused(split_model, tmp_path):
    _, parts = split_model
    for part in parts:
        shutil.copy(part, tmp_path / part.name)
    first, second = tmp_path / parts[0].name, tmp_path / parts[1].name
    swap = tmp_path / "swap"
    first.rename(swap)
    second.rename(first)
    swap.rename(second)
    with pytest.raises(ModelLoadError, match="not part 1 of"):
        GGUFFile(first)
    renamed = tmp_path / "model.gguf"
    second.rename(renamed)  # a part under a name that is not a part's
    with pytest.raises(ModelLoadError, match="its name is not"):
        GGUFFile(renamed)


def test_a_split_quantization_is_pulled_whole_from_the_hub(split_model, monkeypatch, tmp_path):
    from hub_harness import FakeHub

    from runlm import hub

    whole, parts = split_model
    repo = "loopback/tiny-split-GGUF"
    files = {part.name.replace('q8_0', 'Q8_0'): part for part in parts}
    files["tiny-Q4_0.gguf"] = whole  # another quantization beside it
    server = FakeHub({repo: files})
    try:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("RUNLM_HOME", str(tmp_path / "home"))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        model, projector = hub.pull(hub.parse_ref(f"hf.co/{repo}:Q8_0"), progress=False)
        [(name, listed, size)] = hub.pulled()  # `runlm list`: the split model once, all its parts' bytes
    finally:
        server.close()
    assert listed == model and name.endswith(model.name) and size == sum(p.stat().st_size for p in parts)
    assert projector is None and model.name.endswith(f"-00001-of-{len(parts):05d}.gguf")
    assert [p.read_bytes() == q.read_bytes() for p, q in zip(GGUFFile(model).paths, parts)] == [True] * len(parts)
    assert np.array_equal(logits(model), logits(whole))
