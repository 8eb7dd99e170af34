"""Byte-level BPE (GGUF's 'gpt2' tokenizer model: Llama 3, Qwen, SmolLM, gpt-oss) encoded by the native library
(csrc/tokenizer.h, its split patterns matched by csrc/pretok.h).

Building the `tokenizers` library's BPE from a GGUF hands it every piece and merge as Python strings: a tenth of a
second for a 150k vocabulary, most of a small model's load. The native encoder keys the pieces by the bytes they stand
for and the merges by the pair of ids they join, and gives the `tokenizers` backend's ids (tests/text compares them).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

import numpy as np

from runlm.errors import TokenizerError

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


class BpeEncoder:
    """One byte-level BPE vocabulary: the native encoder, its added tokens (matched whole in text), and the decoder.

    `tokens` are the file's spellings and `types` their GGUF token types; `merges` the file's "left right" merges, best
    first; `patterns` the split regexes, each applied to every piece the ones before it cut; `ignore_merges`: a piece
    the vocabulary holds whole is that token (Llama 3's rule).
    """

    def __init__(self, tokens: Sequence[str], types: Sequence[int], merges: Sequence[str],
                 patterns: Sequence[str], *, ignore_merges: bool):
        from runlm.native.library import library  # the kernels' library: loaded by the native runtime anyway

        self._lib = library()
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
        pattern_blob = ("\0".join(patterns) + "\0").encode("utf-8")
        handle = self._lib.rl_bpe_new(blob, len(blob), len(tokens), kinds.ctypes.data, merge_blob, len(merge_blob),
                                      len(merges), pattern_blob, len(pattern_blob), len(patterns), int(ignore_merges))
        if not handle:  # a pattern outside the native language, a piece holding a NUL: the `tokenizers` route
            raise TokenizerError(self._lib.rl_last_error().decode(errors="replace"))
        self._handle = ctypes.c_void_p(handle)
        self._free = self._lib.rl_bpe_free
        self._tokens = tokens
        self._types = kinds
        self.vocab_size: int = self._lib.rl_bpe_size(self._handle)
        self.hidden_ids: frozenset[int] = frozenset()
        if self.vocab_size != len(tokens):  # a repeated spelling answers to its last id only, as in `tokenizers`
            every = range(len(tokens))
            self.hidden_ids = frozenset(i for i, owned in zip(every, self.own_ids(every), strict=True) if not owned)
        self.added: dict[int, tuple[str, bool]] = {}
        self.added_ids: dict[str, int] = {}
        self._bytes: dict[int, bytes] = {}

    def add_tokens(self, added: Mapping[int, tuple[str, bool]]) -> None:
        """Tokens matched whole in text, id -> (text, special); a special one is read as text where asked."""
        for token_id, (text, special) in added.items():
            if not text:  # nothing in text can match it (`tokenizers` leaves an empty token out too)
                continue
            data = text.encode("utf-8", "surrogatepass")
            self._check(self._lib.rl_bpe_add_token(self._handle, data, len(data), token_id, int(special)))
            self.added[token_id] = (text, special)
            self.added_ids[text] = token_id

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._free(handle)

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise TokenizerError(self._lib.rl_last_error().decode(errors="replace"))

    def encode(self, text: str, *, specials_as_text: bool = False, after_special: bool = False) -> list[int]:
        """Ids of `text` (`after_special` changes nothing: byte-level BPE adds no prefix); the native call lets go of
        the GIL, as `tokenizers`' encode_batch does."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"the text is not valid Unicode: {exc}") from None
        count = ctypes.c_int64(0)
        room = len(data) + 16
        while True:
            out = np.empty(room, dtype=np.int32)
            self._check(self._lib.rl_bpe_encode(self._handle, data, len(data), _SPECIALS_AS_TEXT if specials_as_text
                                                else 0, out.ctypes.data, room, ctypes.byref(count)))
            if count.value <= room:
                return out[: count.value].tolist()
            room = count.value

    def piece_id(self, text: str) -> int | None:
        """The id of the piece spelled `text` (its last where spellings repeat), or None."""
        data = text.encode("utf-8", "surrogatepass")
        found = self._lib.rl_bpe_piece_id(self._handle, data, len(data))
        return found if found >= 0 else None

    def own_ids(self, ids: Iterable[int]) -> list[bool]:
        """For each id, whether the vocabulary finds that piece's spelling at it (not at a later repeat)."""
        ids_array = np.ascontiguousarray(list(ids), dtype=np.int64)
        out = np.zeros(len(ids_array), dtype=np.uint8)
        self._check(self._lib.rl_bpe_own_ids(self._handle, ids_array.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                             len(ids_array), out.ctypes.data))
        owned = out.astype(bool).tolist()
        # a control token written outside the byte alphabet is keyed by its text: owned where no later one repeats it
        for k, token_id in enumerate(ids_array.tolist()):
            if not owned[k] and self._types[token_id] in (_CONTROL, _USER_DEFINED):
                owned[k] = self.piece_id(self._tokens[token_id]) == token_id
        return owned

    def spelling(self, token_id: int) -> str:
        """Piece `token_id`'s spelling in the vocabulary: byte-level, or respelled where the file wrote it as text."""
        token = self._tokens[token_id]
        _, from_char = byte_alphabet()
        if self._types[token_id] in (_CONTROL, _USER_DEFINED) or all(c in from_char for c in token):
            return token
        return respelled(token)

    def token_to_id(self, text: str) -> int | None:
        """An added token's id, else the piece's."""
        found = self.added_ids.get(text)
        return found if found is not None else self.piece_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        """An added token's text, else the piece's spelling; None for a repeated spelling's earlier ids."""
        added = self.added.get(token_id)
        if added is not None:
            return added[0]
        return None if token_id in self.hidden_ids else self.spelling(token_id)

    def decode(self, ids: Iterable[int], skip_special: bool) -> str:
        added, hidden, cache = self.added, self.hidden_ids, self._bytes
        parts = []
        for i in ids:
            if i in hidden or (skip_special and added.get(i, ("", False))[1]):
                continue
            data = cache.get(i)
            if data is None:
                data = cache[i] = spelled_bytes(added[i][0] if i in added else self.spelling(i))
            parts.append(data)
        return b"".join(parts).decode("utf-8", "replace")
