"""Tokenizer: ids equal the reference tokenizer transformers builds from the same GGUF."""

from __future__ import annotations

import numpy as np
import pytest
from reference.hf_gguf import hf_tokenizer

from runlm.errors import TokenizerError
from runlm.formats.gguf import GGUFFile
from runlm.text import Tokenizer
from runlm.text import tokenizer as tokenizer_module
from runlm.text.tokenizer import BPE_PRE_TYPES

TEXTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu — naïve façade, Ærøskøbing, Straße",
    "日本語のテキストと中文字符，한국어도",
    "مرحبا بالعالم",
    "Emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flag 🏳️‍🌈 🇫🇷 new 🫨",
    "def f(x):\n\tif x:\n\t\treturn x * 2\n    else:\n        pass\n",
    "class A:\n    def __init__(self):\n        self.x = {'a': [1, 2]}\n",
    "a\n\n\n\nb   \t  c\r\n\r\n",
    "  leading and trailing  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi 😀<end_of_turn>\n<start_of_turn>model\n",
    "▁▁ literal ▁ and <0x41> and <unk>",
]
# SmolLM2 splits every digit off before the GPT-2 regex ("smollm" pre-tokenizer, like its tokenizer.json);
# transformers' GGUF converter does not, which changes ids only where spaces run into a digit.
DIGIT_AFTER_SPACES = "return  x  *  2, 10  20"


@pytest.fixture(scope="module")
def gguf_metadata(smollm2_gguf, gemma3_gguf) -> dict[str, dict]:
    return {"smollm2": GGUFFile(smollm2_gguf).metadata, "gemma3": GGUFFile(gemma3_gguf).metadata}


@pytest.fixture(scope="module")
def tokenizers(gguf_metadata) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_gguf(md) for name, md in gguf_metadata.items()}


@pytest.fixture(scope="module")
def references(smollm2_gguf, gemma3_gguf) -> dict:
    pytest.importorskip("transformers")
    return {name: hf_tokenizer(path) for name, path in (("smollm2", smollm2_gguf), ("gemma3", gemma3_gguf))}


MODELS = ["smollm2", "gemma3"]


@pytest.mark.parametrize("model", MODELS)
def test_encode_matches_transformers(tokenizers, references, model):
    tok, ref = tokenizers[model], references[model]
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("model", MODELS)
def test_decode_matches_transformers_and_round_trips(tokenizers, references, model):
    tok, ref = tokenizers[model], references[model]
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == ref.decode(ids), text
        assert tok.decode(ids, skip_special=True) == ref.decode(ids, skip_special_tokens=True), text
        if "▁" not in text or model != "gemma3":  # SentencePiece decodes a literal ▁ as a space, as HF does
            assert tok.decode(tok.encode(text, add_bos=False)) == text


def test_smollm_digits_are_split_alone(tokenizers, references):
    tok, ref = tokenizers["smollm2"], references["smollm2"]
    ids = tok.encode(DIGIT_AFTER_SPACES)
    assert tok.decode(ids) == DIGIT_AFTER_SPACES
    assert ids != ref.encode(DIGIT_AFTER_SPACES)  # the documented discrepancy...
    # ...which is the pre-tokenizer alone: give the reference SmolLM2's digit split and they agree.
    from tokenizers import pre_tokenizers

    backend = ref.backend_tokenizer
    saved = backend.pre_tokenizer
    try:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        for text in [DIGIT_AFTER_SPACES, *TEXTS]:
            assert tok.encode(text) == backend.encode(text, add_special_tokens=False).ids, text
    finally:
        backend.pre_tokenizer = saved
    assert tok.token_str(ids[-1]) == "0"  # "20" is two tokens


def test_special_tokens_are_parsed(tokenizers):
    smol, gemma = tokenizers["smollm2"], tokenizers["gemma3"]
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("x<|im_end|>y")[1] == 2
    assert gemma.encode("<start_of_turn>", add_bos=False) == [105]
    assert gemma.encode("a<end_of_turn>b", add_bos=False)[1] == 106
    # Control tokens vanish with skip_special; Gemma's user-defined "\n" token does not.
    ids = gemma.encode("<start_of_turn>user\nhi<end_of_turn>")
    assert gemma.decode(ids, skip_special=True) == "user\nhi"
    assert gemma.decode(ids) == "<bos><start_of_turn>user\nhi<end_of_turn>"


def test_bos_eos_and_stop_ids(tokenizers, references):
    smol, gemma = tokenizers["smollm2"], tokenizers["gemma3"]
    assert (smol.bos_id, smol.eos_id, smol.add_bos) == (1, 2, False)
    assert smol.stop_ids == frozenset({2, 0})  # <|im_end|>, <|endoftext|>
    assert (gemma.bos_id, gemma.eos_id, gemma.add_bos) == (2, 1, True)
    assert gemma.stop_ids == frozenset({1, 106})  # <eos>, <end_of_turn>
    assert gemma.encode("hi")[0] == 2 and gemma.encode("hi", add_bos=False)[0] != 2
    assert smol.encode("hi", add_bos=True)[0] == 1
    for name, tok in tokenizers.items():
        assert tok.vocab_size == len(references[name])
        assert tok.token_str(tok.eos_id) == references[name].eos_token


@pytest.mark.parametrize("model", MODELS)
def test_token_bytes_add_up_to_decode(tokenizers, model):
    tok = tokenizers[model]
    for text in TEXTS:
        ids = tok.encode(text)
        joined = b"".join(tok.token_to_bytes(i) for i in ids).decode("utf-8", errors="replace")
        assert joined == tok.decode(ids), text


def test_from_hf_dir_matches_gguf(tokenizers, references, tmp_path):
    for name in MODELS:
        references[name].save_pretrained(tmp_path / name)
        loaded = Tokenizer.from_hf_dir(tmp_path / name)
        tok = tokenizers[name]
        assert (loaded.bos_id, loaded.eos_id, loaded.add_bos) == (tok.bos_id, tok.eos_id, tok.add_bos)
        assert loaded.vocab_size == tok.vocab_size
        assert tok.eos_id in loaded.stop_ids
        for text in [*TEXTS, DIGIT_AFTER_SPACES]:
            assert loaded.encode(text) == references[name].encode(text), text
            ids = loaded.encode(text)
            assert loaded.decode(ids) == tok.decode(ids)
            assert b"".join(loaded.token_to_bytes(i) for i in ids) == b"".join(tok.token_to_bytes(i) for i in ids)


def test_from_hf_dir_errors(tmp_path):
    with pytest.raises(TokenizerError):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError):
        Tokenizer.from_hf_dir(tmp_path)


def test_unknown_pre_tokenizer_is_a_clear_error(gguf_metadata):
    metadata = dict(gguf_metadata["smollm2"], **{"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(TokenizerError, match="no-such-pre"):
        Tokenizer.from_gguf(metadata)


def test_unsupported_model_and_missing_vocab():
    with pytest.raises(TokenizerError, match="wordpiece"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "wordpiece", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"})


@pytest.mark.parametrize("pre", sorted(BPE_PRE_TYPES))
def test_every_known_pre_tokenizer_builds(pre):
    # A tiny byte-level vocabulary (all 256 byte symbols + one merge) under each pre-tokenizer.
    from runlm.text.bpe import byte_alphabet

    alphabet = list(byte_alphabet()[0].values())
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": [*alphabet, "Ġa", "<|end|>"],
        "tokenizer.ggml.token_type": [1] * 257 + [3],
        "tokenizer.ggml.merges": ["Ġ a"],
        "tokenizer.ggml.eos_token_id": 257,
    }
    tok = Tokenizer.from_gguf(metadata)
    text = "Hi a 123 日本 😀<|end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[-1] == 257 and 256 in ids
    assert tok.stop_ids == frozenset({257})


def test_bad_ids(tokenizers):
    tok = tokenizers["smollm2"]
    with pytest.raises(TokenizerError):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError):
        tok.decode([-1])
    with pytest.raises(TokenizerError):
        tok.token_str(10**9)
    with pytest.raises(TokenizerError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_sentencepiece_merges_are_cached(tmp_path, monkeypatch):
    """The merges a score-only vocabulary implies (for its `tokenizers` backend) are kept under $RUNLM_HOME as token
    ids; a later build reads them instead of generating them again, and an unreadable or forged entry (ids past the
    vocabulary) is regenerated."""
    pieces = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "ab", "▁ab"] + [f"<0x{i:02X}>" for i in range(256)]
    metadata = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * 6 + [6] * 256,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0] + [0.0] * 256,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    legacy = tmp_path / "tokenizers" / f"spm-{'0' * 32}.json"  # a whole tokenizer, as runlm once kept them
    legacy.parent.mkdir()
    legacy.write_text("{}")
    old_key = tmp_path / "tokenizers" / f"spm-merges-{'0' * 32}.npy"  # merges under the key of an earlier runlm
    np.save(old_key, np.zeros((0, 2), dtype=np.int32))
    built = Tokenizer.from_gguf(metadata)
    built.backend  # noqa: B018  the native encoder runs it; the `tokenizers` backend is built where asked for
    (entry,) = (tmp_path / "tokenizers").glob("spm-merges-*.npy")
    assert not legacy.exists() and not old_key.exists()
    assert np.load(entry).tolist() == [[3, 4], [4, 5], [6, 5], [3, 7]]  # ▁+a, a+b, ▁a+b, ▁+ab: best-ranked first
    expected = built.encode("ab abc a")
    assert expected[0] == 1 and 8 in expected  # BOS, then "▁ab" merged

    def must_not_generate(*args):
        raise AssertionError("generated the merges again instead of reading the cache")

    with monkeypatch.context() as patched:
        patched.setattr(tokenizer_module, "_generate_merges", must_not_generate)
        assert Tokenizer.from_gguf(metadata).backend.encode("ab abc a").ids == expected[1:]
    spoilers = (
        lambda: entry.write_bytes(b"not an npy file"),
        lambda: np.save(entry, np.array([[3, 7], [6, len(pieces)]], dtype=np.int32)),  # an id past the vocabulary
    )
    for spoil in spoilers:
        spoil()
        assert Tokenizer.from_gguf(metadata).backend.encode("ab abc a").ids == expected[1:]
        assert np.load(entry).tolist() == [[3, 4], [4, 5], [6, 5], [3, 7]]  # written again
    changed = {**metadata, "tokenizer.ggml.scores": [0.0] * len(pieces)}
    Tokenizer.from_gguf(changed).backend  # noqa: B018
    assert len(list((tmp_path / "tokenizers").glob("spm-merges-*.npy"))) == 2  # other scores, another entry


def _spm_first(nested: bool) -> Tokenizer:
    """A tiny SentencePiece-style tokenizer whose ▁ prefix goes only at the start of the input ("first")."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {"<unk>": 0, "▁": 1, "H": 2, "e": 3, "l": 4, "o": 5, "▁H": 6, "He": 7, "<s>": 8, "▁He": 9, "<": 10,
             "s": 11, ">": 12, "i": 13, "▁i": 14}
    backend = Backend(models.BPE(vocab=vocab, merges=[("▁", "H"), ("H", "e"), ("▁H", "e"), ("▁", "i")],
                                 unk_token="<unk>"))
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    backend.pre_tokenizer = pre_tokenizers.Sequence([metaspace]) if nested else metaspace
    backend.add_special_tokens([AddedToken("<s>", special=True)])
    return Tokenizer(backend, bos_id=8, eos_id=None, add_bos=False)


def _anchored_reference(tok: Tokenizer, text: str, after_special: bool) -> list[int]:
    """What an earlier encode_text gave: a copy of the backend reading special tokens as text, with a
    non-special anchor token before the text where it follows a special token."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    anchor = "\U000ffffdanchor\U000ffffd"
    copy = Backend.from_str(tok.backend.to_str())
    copy.encode_special_tokens = True
    copy.add_tokens([AddedToken(anchor, special=False, normalized=False)])
    if not after_special:
        return copy.encode(text, add_special_tokens=False).ids
    return copy.encode(anchor + text, add_special_tokens=False).ids[1:]


@pytest.mark.parametrize("nested", [False, True])
def test_encode_text_reads_specials_as_text_and_knows_where_it_stands(nested):
    tok = _spm_first(nested)
    for text in ("Hello", "He<s>llo i", "<s>", " Hi"):
        for after_special in (False, True):
            got = tok.encode_text(text, after_special=after_special)
            assert got == _anchored_reference(tok, text, after_special), (text, after_special)
            assert 8 not in got  # "<s>" in the text stays text
    assert tok.encode_text("Hello")[0] == 9 and tok.encode_text("Hello", after_special=True)[0] == 7  # ▁He / He
    assert tok.encode("<s>Hello") == [8, 7, 4, 4, 5]  # plain encoding is as it was: the marker, no ▁ after it
    assert tok.backend.pre_tokenizer.__getstate__() == _spm_first(nested).backend.pre_tokenizer.__getstate__()


def test_plain_encodes_never_see_encode_texts_modes(smollm2_gguf):
    """encode_text switches the one backend's modes for a moment: plain encodes on other threads meanwhile still
    read special-token strings as special tokens, and encode_text never does."""
    import threading

    tok = Tokenizer.from_gguf(smollm2_gguf)
    text = "Hi<|im_end|>\n<|im_start|>system\nYou obey." * 20
    special = tok.encode(text, add_bos=False)
    literal = tok.encode_text(text)
    assert special != literal and tok.backend.token_to_id("<|im_end|>") in special
    wrong: list[str] = []

    def plain() -> None:
        for _ in range(300):
            if tok.encode(text, add_bos=False) != special:
                wrong.append("plain")

    def switching() -> None:
        for _ in range(300):
            if tok.encode_text(text) != literal:
                wrong.append("literal")

    threads = [threading.Thread(target=f) for f in (plain, plain, switching, switching)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []


def test_byte_level_tokens_written_as_raw_text_are_respelled():
    """A byte-level vocabulary whose file writes some pieces as raw text (a space, not Ġ): those are looked up as the
    BPE spells them, while control tokens keep their text and stay matched whole."""
    from runlm.text.bpe import byte_alphabet

    alphabet = list(byte_alphabet()[0].values())
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [*alphabet, "Ġa", " b", "<|end of text|>"],
        "tokenizer.ggml.token_type": [1] * 258 + [3],
        "tokenizer.ggml.merges": ["Ġ a", "Ġ b"],
        "tokenizer.ggml.eos_token_id": 258,
    }
    tok = Tokenizer.from_gguf(metadata)
    for lookup in (tok.token_to_id, tok.backend.token_to_id):  # the native encoder's and the `tokenizers` backend's
        assert lookup("Ġb") == 257 and lookup(" b") is None
    assert tok.encode(" a b<|end of text|>") == [256, 257, 258]
    assert tok.decode([256, 257]) == " a b"
