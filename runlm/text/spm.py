"""SentencePiece BPE (GGUF's 'llama' tokenizer model) encoded by the native library (csrc/tokenizer.h).

A GGUF SentencePiece vocabulary has pieces and scores but no merges; the `tokenizers` library needs the merge list they
imply, and building it with its tables took Gemma 3's 262k pieces most of a second, more than the rest of a model's
load. The native encoder ranks a pair when it meets it, from the same keys the merge list is sorted by, and gives the
`tokenizers` backend's ids (tests/text compares them); its tables take a few milliseconds to build.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence

import numpy as np

from runlm.errors import TokenizerError
from runlm.text.native_vocab import NativeVocabulary

META = "▁"  # U+2581, SentencePiece's space
PREFIX_NONE, PREFIX_EACH_PIECE, PREFIX_FIRST_PIECE = 0, 1, 2  # the dummy prefix rule (tokenizer.h's SpmPrefix)
_SPECIALS_AS_TEXT, _AFTER_SPECIAL = 1, 2
_HEX = frozenset("0123456789abcdefABCDEF")


class SpmEncoder(NativeVocabulary):
    """One SentencePiece vocabulary: the native encoder, with its added tokens (matched whole in text) and unknown
    piece, and the decoder.

    `pieces` as the model spells them (a space run respelled with ▁ where the model does), `scores` the ranking of the
    merge that makes each piece (higher merges first), `prefix` the dummy prefix rule, `strip_one_space` whether
    decoding drops the space that prefix reads as.
    """

    _PREFIX = "rl_spm_"

    def __init__(self, pieces: Sequence[str], scores: np.ndarray, *, prefix: int, strip_one_space: bool):
        from runlm.native.library import library  # the kernels' library: loaded by the native runtime anyway

        lib = library()
        scores = np.nan_to_num(np.ascontiguousarray(scores, dtype=np.float64), nan=-np.inf)
        if scores.shape != (len(pieces),):
            raise TokenizerError(f"{scores.size} scores for {len(pieces)} pieces")
        try:
            blob = ("\0".join(pieces) + "\0").encode("utf-8", "surrogatepass")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"a piece of the vocabulary is not text: {exc}") from None
        # The spellings as the library got them, NUL after each, and where each ends: 3.5 MB for Gemma's 262k where a
        # list of str took 20 MB (a grammar reads every piece's bytes, a stream each token's)
        self._blob = blob
        self._ends = array.array("q")
        self._ends.frombytes(np.flatnonzero(np.frombuffer(blob, dtype=np.uint8) == 0).astype(np.int64).tobytes())
        self.strip_one_space = strip_one_space
        # a piece holding a NUL, say, makes the library refuse it
        self._open(lib, lib.rl_spm_new(blob, len(blob), len(pieces), scores.ctypes.data, prefix), len(pieces))

    def set_unknown(self, unknown_id: int | None) -> None:
        """The piece a character gets that neither the vocabulary nor its byte pieces spell (None: it is dropped)."""
        self._check(self._call("set_unknown", -1 if unknown_id is None else unknown_id))

    def encode(self, text: str, *, specials_as_text: bool = False, after_special: bool = False) -> list[int]:
        """Ids of `text`."""
        return self._encode(text, (_SPECIALS_AS_TEXT if specials_as_text else 0) |
                            (_AFTER_SPECIAL if after_special else 0))

    def spelling(self, token_id: int) -> str:
        """Piece `token_id`'s spelling."""
        start = self._ends[token_id - 1] + 1 if token_id else 0
        return self._blob[start : self._ends[token_id]].decode("utf-8", "surrogatepass")

    def decode(self, ids: Iterable[int], skip_special: bool) -> str:
        added = self.added
        return decode_pieces((added[i][0] if i in added else self.spelling(i) for i in self.kept(ids, skip_special)),
                             self.strip_one_space)


def _byte_piece(token: str) -> int | None:
    """The byte a <0xNN> piece stands for (the `tokenizers` ByteFallback decoder's reading of one), else None."""
    if len(token) != 6 or not token.startswith("<0x") or token[5] != ">":
        return None
    digits = token[3:5]
    if all(c in _HEX for c in digits) or (digits[0] == "+" and digits[1] in _HEX):
        return int(digits, 16)
    return None


def decode_pieces(tokens: Iterable[str], strip_one_space: bool) -> str:
    """Text of SentencePiece token spellings: ▁ read as a space, runs of <0xNN> pieces as UTF-8 (a run that is not
    valid UTF-8 gives one U+FFFD per byte), then one leading space dropped where the encoder added a dummy prefix."""
    parts: list[str] = []
    pending = bytearray()
    for token in tokens:
        token = token.replace(META, " ")
        byte = _byte_piece(token)
        if byte is not None:
            pending.append(byte)
            continue
        if pending:
            parts.append(_bytes_text(pending))
            pending.clear()
        parts.append(token)
    if pending:
        parts.append(_bytes_text(pending))
    text = "".join(parts)
    return text[1:] if strip_one_space and text.startswith(" ") else text


def _bytes_text(data: bytearray) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(data)
