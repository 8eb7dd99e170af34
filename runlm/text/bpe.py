"""Byte-level BPE (GGUF's 'gpt2' tokenizer model: Llama 3, Qwen, SmolLM, gpt-oss) encoded by the native library
(csrc/tokenizer.h, its split patterns matched by csrc/pretok.h).

Building the `tokenizers` library's BPE from a GGUF hands it every piece and merge as Python strings: a tenth of a
second for a 150k vocabulary, most of a small model's load. The native encoder keys the pieces by the bytes they stand
for and the merges by the pair of ids they join, and gives the `tokenizers` backend's ids (tests/text compares them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

from runlm.errors import TokenizerError
from runlm.text.native_vocab import NativeVocabulary

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types whose text, outside the byte alphabet, stays as written
_SPECIALS_AS_TEXT = 1  # tokenizer.h's kSpecialsAsText


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's printable spelling of every byte, both ways."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    to_char = {b: chr(c) for b, c in zip(printable, chars, strict=True)}
    return to_char, {c: b for b, c in to_char.items()}


@lru_cache(maxsize=1)
def outside_byte_alphabet() -> re.Pattern[str]:
    """A character GPT-2's byte alphabet does not have: a token holding one is spelled as raw text."""
    to_char, _ = byte_alphabet()
    return re.compile(f"[^{re.escape(''.join(sorted(to_char.values())))}]")


def vocabulary_spelling(token: str, kind: int) -> str:
    """A GGUF token as the byte-level vocabulary spells it: as written, unless the file wrote it as raw text (a
    character outside the byte alphabet) and it is neither a control nor a user-defined token (GGUF type `kind`)."""
    if kind in (_CONTROL, _USER_DEFINED) or not outside_byte_alphabet().search(token):
        return token
    return respelled(token)


def respelled(token: str) -> str:
    """A token written as raw text, spelled the way byte-level BPE spells its bytes."""
    to_char, _ = byte_alphabet()
    return "".join(to_char[b] for b in token.encode("utf-8"))


def spelled_bytes(token: str) -> bytes:
    """The bytes a token stands for in decoded text (the `tokenizers` ByteLevel decoder's reading): its byte-level
    spelling read back, or its own UTF-8 where it is not so spelled (an added token written as text)."""
    _, from_char = byte_alphabet()
    try:
        return bytes(from_char[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


class BpeEncoder(NativeVocabulary):
    """One byte-level BPE vocabulary: the native encoder, its added tokens (matched whole in text), and the decoder.

    `tokens` are the file's spellings and `types` their GGUF token types; `merges` the file's "left right" merges, best
    first; `patterns` the split regexes, each applied to every piece the ones before it cut; `ignore_merges`: a piece
    the vocabulary holds whole is that token (Llama 3's rule).
    """

    _PREFIX = "rl_bpe_"

    def __init__(self, tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                 patterns: Sequence[str], *, ignore_merges: bool):
        from runlm.native.library import library  # the kernels' library: loaded by the native runtime anyway

        lib = library()
        try:
            blob = ("\0".join(tokens) + "\0").encode("utf-8", "surrogatepass")
            merge_blob = ("\0".join(merges) + "\0").encode("utf-8", "surrogatepass") if merges else b""
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"a piece of the vocabulary is not text: {exc}") from None
        try:
            kinds = np.ascontiguousarray(types, dtype=np.int32)
        except (OverflowError, ValueError, TypeError):
            raise TokenizerError("token types must be small integers") from None
        if kinds.shape != (len(tokens),):
            raise TokenizerError(f"{kinds.size} token types for {len(tokens)} tokens")
        self._tokens = tokens
        self._types = kinds
        self._bytes: dict[int, bytes] = {}
        pattern_blob = ("\0".join(patterns) + "\0").encode("utf-8")
        # a pattern outside the native language or a piece holding a NUL makes the library refuse it
        self._open(lib, lib.rl_bpe_new(blob, len(blob), len(tokens), kinds.ctypes.data, merge_blob, len(merge_blob),
                                       len(merges), pattern_blob, len(pattern_blob), len(patterns),
                                       int(ignore_merges)), len(tokens))

    def encode(self, text: str, *, specials_as_text: bool = False, after_special: bool = False) -> list[int]:
        """Ids of `text` (`after_special` changes nothing: byte-level BPE adds no prefix)."""
        return self._encode(text, _SPECIALS_AS_TEXT if specials_as_text else 0)

    def own_ids(self, ids: Iterable[int]) -> list[bool]:
        ids = list(ids)
        owned = super().own_ids(ids)
        # a control token written outside the byte alphabet is keyed by its text: owned where no later one repeats it
        for k, token_id in enumerate(ids):
            if not owned[k] and self._types[token_id] in (_CONTROL, _USER_DEFINED):
                owned[k] = self.piece_id(self._tokens[token_id]) == token_id
        return owned

    def spelling(self, token_id: int) -> str:
        """Piece `token_id`'s spelling in the vocabulary: byte-level, or respelled where the file wrote it as text."""
        return vocabulary_spelling(self._tokens[token_id], self._types[token_id])

    def decode(self, ids: Iterable[int], skip_special: bool) -> str:
        added, cache = self.added, self._bytes
        parts = []
        for i in self.kept(ids, skip_special):
            data = cache.get(i)
            if data is None:
                data = cache[i] = spelled_bytes(added[i][0] if i in added else self.spelling(i))
            parts.append(data)
        return b"".join(parts).decode("utf-8", "replace")
