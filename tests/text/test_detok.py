"""Streaming detokenization: chunks add up to the full decode and never split a character."""

from __future__ import annotations

import pytest

from runlm.formats.gguf import GGUFFile
from runlm.text import StreamingDetokenizer, Tokenizer

STREAM_TEXTS = [
    "Hello, world! Ça va? 日本語のテキスト、中文字符。",
    "Emoji: 😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 and 🫨 done",
    "مرحبا بالعالم — עברית — ελληνικά — हिन्दी",
    "def f(x):\n\tif x:\n\t\treturn x * 2\n\n\n    # 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫≠\n",
    "<|im_start|>user\nhi 😀<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces, trailing  ",
]


@pytest.fixture(scope="module")
def smollm(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(smollm2_gguf).metadata)


def _spm_metadata(add_space_prefix: bool) -> dict:
    """A tiny llama-style SentencePiece vocabulary: most characters only exist as <0xNN> byte tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "a", "b", "▁a", "▁b", "ab", "▁ab", "é", "▁é", "日", "<|im_end|>"]
    tokens += pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [3, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [3]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    detok = StreamingDetokenizer(tok, skip_special=skip_special)
    chunks = [detok.push(i) for i in ids]
    chunks.append(detok.flush())
    assert detok.text == "".join(chunks)
    return chunks


def _check_stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    chunks = _stream(tok, ids, skip_special)
    assert "".join(chunks) == tok.decode(ids, skip_special=skip_special)
    assert not any("\ufffd" in c for c in chunks), chunks
    return chunks


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_byte_level_stream_equals_decode(smollm: Tokenizer, text: str):
    ids = smollm.encode(text)
    _check_stream(smollm, ids)
    _check_stream(smollm, ids, skip_special=True)


def test_byte_level_holds_back_split_characters(smollm: Tokenizer):
    # SmolLM2 has no token for this emoji: its 4 UTF-8 bytes come out as several byte tokens.
    ids = smollm.encode("🫨")
    assert len(ids) > 1
    chunks = _check_stream(smollm, ids)
    assert chunks[: len(ids) - 1] == [""] * (len(ids) - 1)
    assert "".join(chunks) == "🫨"


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("text", ["ab 日本 😀 é", "a b ü  c ", "👨‍👩‍👧 abé<|im_end|>a"])
def test_byte_fallback_stream_equals_decode(text: str, prefix: bool):
    tok = Tokenizer.from_gguf(_spm_metadata(add_space_prefix=prefix))
    ids = tok.encode(text)
    assert any(tok.token_str(i).startswith("<0x") for i in ids)  # the byte-fallback path is exercised
    chunks = _check_stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    assert tok.decode(ids, skip_special=True) == text.replace("<|im_end|>", "")
    _check_stream(tok, ids, skip_special=True)
    _check_stream(tok, ids[1:])  # without BOS, the first token's dummy-prefix space is dropped as decode does


def test_unfinished_character_is_flushed_as_replacement(smollm: Tokenizer):
    ids = smollm.encode("😀")
    partial = ids[:-1] if len(ids) > 1 else None
    if partial is None:  # the emoji is one token here: build a broken stream from byte tokens instead
        tok = Tokenizer.from_gguf(_spm_metadata(add_space_prefix=False))
        partial = [tok.encode("😀", add_bos=False)[0]]
        smollm = tok
    detok = StreamingDetokenizer(smollm)
    assert "".join(detok.push(i) for i in partial) == ""
    assert detok.flush() == "\ufffd"


def test_reset_starts_a_new_stream(smollm: Tokenizer):
    detok = StreamingDetokenizer(smollm)
    for i in smollm.encode("first"):
        detok.push(i)
    detok.reset()
    assert detok.text == ""
    ids = smollm.encode("second 😀")
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "second 😀"
