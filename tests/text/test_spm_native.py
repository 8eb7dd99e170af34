"""The native SentencePiece encoder (runlm.text.spm) gives the ids the `tokenizers` route gives on the same vocabulary:
Gemma 3's real one, and random vocabularies whose scores tie (the ranking's later keys decide), with repeated pieces,
missing byte pieces and a dummy prefix."""

from __future__ import annotations

import random

import pytest
from test_tokenizer import TEXTS

from runlm.errors import TokenizerError
from runlm.formats.gguf import GGUFFile
from runlm.text import Tokenizer
from runlm.text import tokenizer as tokenizer_module

SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unk>", "<pad>", "<mask>", "<0x41>", "<unused5>",
            "<s>", "</s>", "<|u|>"]
ALPHABET = [*"abcdefghij klmnop  \n\t\r.,;:!?'\"()[]{}<>/-_=+*&^%$#@~`", *"éàüßñçøåÆ—…“”", *"日本語中文한국어",
            "😀", "👍🏽", "\u200d", "\x00", "\x7f", "\U0001F9E0", "▁", "  ", "   ", "\n\n"]


def _texts(pieces: list[str], count: int, seed: int) -> list[str]:
    """Text made of vocabulary pieces (as written and with ▁ for spaces), odd characters and special-token strings."""
    rng = random.Random(seed)
    texts = list(TEXTS)
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(ALPHABET))
            elif r < 0.8:
                parts.append(rng.choice(pieces).replace("▁", " "))
            elif r < 0.9:
                parts.append(rng.choice(pieces))
            else:
                parts.append(rng.choice(SPECIALS))
        texts.append("".join(parts))
    return texts


def _both(metadata: dict, monkeypatch: pytest.MonkeyPatch) -> tuple[Tokenizer, Tokenizer]:
    native = Tokenizer.from_gguf(metadata)
    assert native._native is not None, "the native encoder was not built"
    with monkeypatch.context() as patched:
        patched.setattr(tokenizer_module, "_native_sentencepiece", lambda *args: None)
        reference = Tokenizer.from_gguf(metadata)
    assert reference._native is None
    return native, reference


def _outcome(method, *args) -> object:
    try:
        return method(*args)
    except TokenizerError as exc:
        return type(exc)


def _assert_same(native: Tokenizer, reference: Tokenizer, texts: list[str]) -> None:
    for text in texts:
        ids = reference.encode(text, add_bos=False)
        assert native.encode(text, add_bos=False) == ids, repr(text)
        for after in (False, True):
            assert native.encode_text(text, after_special=after) == reference.encode_text(text, after_special=after), \
                repr(text)
        assert native.decode(ids) == reference.decode(ids), repr(text)
        assert native.encode_with_post_processor(text) == reference.encode_with_post_processor(text), repr(text)
        assert native.decode(ids, skip_special=True) == reference.decode(ids, skip_special=True), repr(text)
    assert (native.vocab_size, native.special_ids, native.stop_ids) == (
        reference.vocab_size, reference.special_ids, reference.stop_ids)
    for token_id in range(0, native.vocab_size, max(1, native.vocab_size // 2000)):
        for method in ("token_str", "token_to_bytes"):  # a repeated piece's earlier id has no entry in either
            assert _outcome(getattr(native, method), token_id) == _outcome(getattr(reference, method), token_id)
    added = {i: (t.content, t.special) for i, t in reference.added_tokens().items()}
    assert {i: (t.content, t.special) for i, t in native.added_tokens().items()} == added
    for text in SPECIALS + ["▁▁", "  ", "a", "nothing-like-this"]:
        assert native.token_to_id(text) == reference.token_to_id(text)


def test_gemma3_matches_the_tokenizers_route(gemma3_gguf, monkeypatch):
    metadata = GGUFFile(gemma3_gguf).metadata
    native, reference = _both(metadata, monkeypatch)
    _assert_same(native, reference, _texts(metadata["tokenizer.ggml.tokens"], 1500, seed=0))
    big = "".join(_texts(metadata["tokenizer.ggml.tokens"], 300, seed=1))  # one long piece of text
    assert native.encode(big) == reference.encode(big)


def _random_vocabulary(seed: int, *, prefix: bool, repeats: bool, bytes_missing: bool) -> dict:
    """A score-only SentencePiece vocabulary (GGUF's 'llama' model) of pieces cut from text, with few distinct
    scores, so that many merges tie on the score."""
    rng = random.Random(seed)
    source = "".join(_texts(["hello", "world", "▁the", "ing"], 200, seed)).replace(" ", "▁")
    pieces = ["<unk>", "<s>", "</s>", "<|u|>", "▁"]
    seen = set(pieces)
    while len(pieces) < 700:
        start = rng.randrange(len(source))
        piece = source[start : start + rng.randint(1, 6)]
        if piece and "\0" not in piece and (piece not in seen or (repeats and rng.random() < 0.01)):
            pieces.append(piece)
            seen.add(piece)
    types = [2, 3, 3, 4] + [1] * (len(pieces) - 4)
    for byte in range(256):
        if not (bytes_missing and byte % 7 == 0):
            pieces.append(f"<0x{byte:02X}>")
            types.append(6)
    scores = [0.0, 0.0, 0.0, 0.0] + [float(rng.randint(-5, 0)) for _ in range(len(pieces) - 4)]
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.add_space_prefix": prefix,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


@pytest.mark.parametrize("seed", range(4))
def test_random_vocabularies_match_the_tokenizers_route(seed, monkeypatch, tmp_path):
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))  # the reference route keeps its merges there
    metadata = _random_vocabulary(seed, prefix=seed % 2 == 0, repeats=seed >= 2, bytes_missing=seed == 3)
    native, reference = _both(metadata, monkeypatch)
    _assert_same(native, reference, _texts(metadata["tokenizer.ggml.tokens"], 400, seed=seed))


def test_a_vocabulary_the_native_encoder_cannot_hold_takes_the_tokenizers_route(monkeypatch, tmp_path):
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    metadata = _random_vocabulary(0, prefix=True, repeats=False, bytes_missing=False)
    metadata["tokenizer.ggml.tokens"] = [*metadata["tokenizer.ggml.tokens"][:-1], "a\0b"]  # a piece with a NUL in it
    tok = Tokenizer.from_gguf(metadata)
    assert tok._native is None and tok.encode("hello world")[0] == 1
