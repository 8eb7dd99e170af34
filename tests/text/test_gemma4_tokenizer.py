"""Gemma 4's tokenizer (GGUF tokenizer model "gemma4") on its real vocabulary: llama.cpp's own test cases for it
(models/ggml-vocab-gemma-4.gguf with its .inp / .out, from the llama-cpp-python sdist), and the stop tokens of its
chat format."""

from __future__ import annotations

import pytest
from reference.converted import GEMMA4_VOCAB_FILE, converter_dir

from runlm.text import Tokenizer


@pytest.fixture(scope="module")
def vocab():
    path = converter_dir() / GEMMA4_VOCAB_FILE
    texts = path.with_name(path.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    return Tokenizer.from_gguf(path), list(zip(texts, ([int(i) for i in line.split()] for line in ids), strict=False))


def test_encodes_every_case_as_llama_cpp(vocab):
    tokenizer, cases = vocab
    assert len(cases) >= 40
    for text, expected in cases:
        assert tokenizer.encode(text, add_bos=False) == expected, repr(text)


def test_decodes_every_case_back(vocab):
    tokenizer, cases = vocab
    for text, expected in cases:
        assert tokenizer.decode(expected) == text, repr(text)
        assert b"".join(tokenizer.token_to_bytes(i) for i in expected) == text.encode("utf-8")


def test_bos_markers_and_stops(vocab):
    tokenizer, _ = vocab
    assert tokenizer.encode("Hi")[0] == tokenizer.bos_id == 2  # llama.cpp adds it for gemma4 whatever the file says
    ids = tokenizer.encode("<|turn>user\nHi<turn|>\n<|tool_call>call:f{}<tool_call|>", add_bos=False)
    markers = {"<|turn>": 105, "<turn|>": 106, "<|tool_call>": 48, "<tool_call|>": 49, "<|tool_response>": 50}
    assert [tokenizer.token_str(i) for i in ids if i in markers.values()] == list(markers)[:4]
    assert tokenizer.stop_ids == {tokenizer.eos_id, markers["<turn|>"], markers["<|tool_response>"]}
