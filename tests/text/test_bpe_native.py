"""The native byte-level BPE encoder (runlm.text.bpe) gives the ids the `tokenizers` route gives on the same vocabulary:
SmolLM2's real one under every split pattern runlm knows, every code point against the regex engine's own Unicode
classes, and random vocabularies with repeated spellings, missing byte pieces, pieces written as text and repeated
merges."""

from __future__ import annotations

import collections
import random

import pytest
from test_spm_native import SPECIALS, _assert_same, _texts

from runlm.formats.gguf import GGUFFile
from runlm.text import Tokenizer
from runlm.text import tokenizer as tokenizer_module
from runlm.text.bpe import BpeEncoder, byte_alphabet, spelled_bytes

PRE_TYPES = sorted({pre.patterns(): name for name, pre in tokenizer_module.BPE_PRE_TYPES.items()}.values())
BYTE_LEVEL_TEXTS = ["don't I'M 'S 'ſ 'K 'll'RE", "ǅungla ʰa Straße ﬁne Ⅻ ٣٤ 1234567 12.5",
                    "a\u00a0b\u2003c\u3000d\x1c\x85e", "x\r\n\r\n  \n\t y  ", "一二三 ひらがな カタカナ ﾟ",
                    "e\u0301 a\u200db", "/path/to\\file/\n", "<|endoftext|>x"]


def _byte_texts(pieces: list[str], count: int, seed: int) -> list[str]:
    """_texts, plus text made of what byte-level pieces spell."""
    spelled = [spelled_bytes(p).decode("utf-8", "replace") for p in pieces]
    return BYTE_LEVEL_TEXTS + _texts(spelled, count, seed) + _texts(pieces, count // 4, seed + 1)


def _both(metadata: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[Tokenizer, Tokenizer]:
    native = Tokenizer.from_gguf(metadata)
    assert isinstance(native._native, BpeEncoder), "the native encoder was not built"
    with monkeypatch.context() as patched:
        patched.setattr(tokenizer_module, "_native_byte_level", lambda *args: None)
        reference = Tokenizer.from_gguf(metadata)
    assert reference._native is None
    return native, reference


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_gguf) -> dict:
    return dict(GGUFFile(smollm2_gguf).metadata)


@pytest.mark.parametrize("pre", PRE_TYPES)
def test_smollm2_matches_the_tokenizers_route_under_every_split(pre, smollm2_metadata, monkeypatch):
    metadata = {**smollm2_metadata, "tokenizer.ggml.pre": pre}
    native, reference = _both(metadata, monkeypatch)
    _assert_same(native, reference, _byte_texts(metadata["tokenizer.ggml.tokens"], 300, seed=len(pre)))


def test_one_long_text(smollm2_metadata, monkeypatch):
    native, reference = _both(smollm2_metadata, monkeypatch)
    big = "".join(_byte_texts(smollm2_metadata["tokenizer.ggml.tokens"], 400, seed=7)) * 4
    assert native.encode(big) == reference.encode(big)
    assert native.encode(" " * 100_000 + "a\n" * 1000) == reference.encode(" " * 100_000 + "a\n" * 1000)


@pytest.mark.parametrize("pre", ["tekken", "deepseek-v3"])  # between them every Unicode class the patterns name
def test_every_code_point_splits_as_the_regex_engine_splits_it(pre, smollm2_metadata, monkeypatch):
    native, reference = _both({**smollm2_metadata, "tokenizer.ggml.pre": pre}, monkeypatch)
    points = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    random.Random(0).shuffle(points)
    for start in range(0, len(points), 50_000):
        text = "".join(points[start : start + 50_000])
        assert native.encode(text) == reference.encode(text)


def _random_vocabulary(seed: int, *, pre: str, repeats: bool, bytes_missing: bool) -> dict:
    """A byte-level vocabulary learned from random text by a few hundred BPE merges, with control tokens (one written
    outside the byte alphabet), a plain token written as text, and, where asked, repeated spellings and merges and
    byte pieces left out."""
    rng = random.Random(seed)
    to_char, _ = byte_alphabet()
    text = "".join(_texts(["hello", "world", " the", "ing", "日本", "😀"], 300, seed)).encode("utf-8")
    kept = [b for b in range(256) if not (bytes_missing and b % 11 == 0)]  # text may hold the others: dropped
    words = [[to_char[b] for b in text[i : i + rng.randint(2, 9)] if b in kept] for i in range(0, len(text), 7)]
    tokens = [to_char[b] for b in kept]
    merges = []
    while len(merges) < 300:
        pairs = collections.Counter((w[i], w[i + 1]) for w in words for i in range(len(w) - 1))
        if not pairs:
            break
        (left, right), _ = pairs.most_common(1)[0]
        merges.append(f"{left} {right}")
        tokens.append(left + right)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (left, right):
                    w[i : i + 2] = [left + right]
                i += 1
    tokens = [t for t in dict.fromkeys(tokens)]  # the vocabulary holds each merge's pieces once...
    if repeats:  # ... unless a file repeats some, and some merges
        tokens += [rng.choice(tokens) for _ in range(5)]
        merges += [rng.choice(merges) for _ in range(5)]
    types = [1] * len(tokens)
    extra = ["<|endoftext|>", "<|im_start|>", "<｜begin▁of▁sentence｜>", "naïve text"]
    tokens += extra
    types += [3, 3, 3, 1]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": len(tokens) - 3,
        "tokenizer.ggml.eos_token_id": len(tokens) - 4,
    }


@pytest.mark.parametrize("seed", range(4))
def test_random_vocabularies_match_the_tokenizers_route(seed, monkeypatch):
    metadata = _random_vocabulary(seed, pre=["llama3", "smollm", "qwen2", "gpt-4o"][seed], repeats=seed >= 2,
                                  bytes_missing=seed % 2 == 1)
    native, reference = _both(metadata, monkeypatch)
    texts = _byte_texts(metadata["tokenizer.ggml.tokens"], 400, seed=seed)
    _assert_same(native, reference, texts + ["<｜begin▁of▁sentence｜>x naïve text", "naïve text"])
    for text in [*SPECIALS, "<｜begin▁of▁sentence｜>", "naïve text", "na\u00c3\u00afve\u0120text"]:
        assert native.token_to_id(text) == reference.token_to_id(text)


def test_a_split_pattern_the_native_encoder_cannot_match_takes_the_tokenizers_route(smollm2_metadata, monkeypatch):
    lazy = tokenizer_module._Pre(r"\p{L}+?|\s+|[^\s\p{L}]+")  # a lazy quantifier: outside pretok.h's language
    monkeypatch.setitem(tokenizer_module.BPE_PRE_TYPES, "lazy-test", lazy)
    tok = Tokenizer.from_gguf({**smollm2_metadata, "tokenizer.ggml.pre": "lazy-test"})
    assert tok._native is None and tok.decode(tok.encode("hello world")) == "hello world"


def test_a_merge_of_unknown_pieces_is_refused_by_both_routes(smollm2_metadata):
    metadata = {**smollm2_metadata}
    metadata["tokenizer.ggml.merges"] = [*smollm2_metadata["tokenizer.ggml.merges"], "zzzq qqqz"]
    with pytest.raises(tokenizer_module.TokenizerError):
        Tokenizer.from_gguf(metadata)


def test_token_types_past_int32_take_the_tokenizers_route_and_past_64_bits_are_refused(smollm2_metadata):
    types = smollm2_metadata["tokenizer.ggml.token_type"]
    tok = Tokenizer.from_gguf({**smollm2_metadata, "tokenizer.ggml.token_type": [2**40, *types[1:]]})
    assert tok._native is None and tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(tokenizer_module.TokenizerError, match="64 bits"):
        Tokenizer.from_gguf({**smollm2_metadata, "tokenizer.ggml.token_type": [2**63 + 5, *types[1:]]})


def test_an_empty_control_token_is_left_out_as_the_tokenizers_route_leaves_it(smollm2_metadata, monkeypatch):
    tokens = [*smollm2_metadata["tokenizer.ggml.tokens"]]
    types = [*smollm2_metadata["tokenizer.ggml.token_type"]]
    tokens[5], types[5] = "", 3
    native, reference = _both({**smollm2_metadata, "tokenizer.ggml.tokens": tokens,
                               "tokenizer.ggml.token_type": types}, monkeypatch)
    _assert_same(native, reference, BYTE_LEVEL_TEXTS)
