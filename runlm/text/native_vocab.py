"""What the native encoders (runlm.text.spm's SentencePiece, runlm.text.bpe's byte-level BPE) share: the kernels'
library handle, the added tokens, the encode call that grows its output, and the lookups by spelling."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from runlm.errors import TokenizerError


class NativeVocabulary:
    """A vocabulary the kernels' library encodes. Its C calls are named `_PREFIX` + "encode", "add_token", ...; a
    subclass makes the handle, hands it to `_open`, and spells its pieces (`spelling`)."""

    _PREFIX = ""

    def _open(self, lib: Any, handle: int | None, count: int) -> None:
        """Take the library's handle of a `count`-piece vocabulary (None or 0: it refused, rl_last_error says why)."""
        if not handle:  # the caller takes the `tokenizers` route
            raise TokenizerError(lib.rl_last_error().decode(errors="replace"))
        self._lib = lib
        self._handle = ctypes.c_void_p(handle)
        self._free = getattr(lib, self._PREFIX + "free")
        # a repeated spelling answers to its last id only, as in `tokenizers`' vocabulary
        self.vocab_size: int = self._call("size")
        self.hidden_ids: frozenset[int] = frozenset()
        if self.vocab_size != count:
            every = range(count)
            self.hidden_ids = frozenset(i for i, owned in zip(every, self.own_ids(every), strict=True) if not owned)
        self.added: dict[int, tuple[str, bool]] = {}
        self.added_ids: dict[str, int] = {}

    def _call(self, name: str, *args: Any) -> Any:
        return getattr(self._lib, self._PREFIX + name)(self._handle, *args)

    def _check(self, rc: int) -> None:
        if rc != 0:
            raise TokenizerError(self._lib.rl_last_error().decode(errors="replace"))

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._free(handle)

    def add_tokens(self, added: Mapping[int, tuple[str, bool]]) -> None:
        """Tokens matched whole in text, id -> (text, special); a special one is read as text where asked."""
        for token_id, (text, special) in added.items():
            if not text:  # nothing in text can match it (`tokenizers` leaves an empty token out too)
                continue
            data = text.encode("utf-8", "surrogatepass")
            self._check(self._call("add_token", data, len(data), token_id, int(special)))
            self.added[token_id] = (text, special)
            self.added_ids[text] = token_id

    def _encode(self, text: str, flags: int) -> list[int]:
        """Ids of `text`; the native call lets go of the GIL, as `tokenizers`' encode_batch does."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"the text is not valid Unicode: {exc}") from None
        count = ctypes.c_int64(0)
        room = len(data) + 16
        while True:
            out = np.empty(room, dtype=np.int32)
            self._check(self._call("encode", data, len(data), flags, out.ctypes.data, room, ctypes.byref(count)))
            if count.value <= room:
                return out[: count.value].tolist()
            room = count.value

    def piece_id(self, text: str) -> int | None:
        """The id of the piece spelled `text` (its last where spellings repeat), or None."""
        data = text.encode("utf-8", "surrogatepass")
        found = self._call("piece_id", data, len(data))
        return found if found >= 0 else None

    def own_ids(self, ids: Iterable[int]) -> list[bool]:
        """For each id, whether the vocabulary finds that piece's spelling at it (not at a later repeat)."""
        ids_array = np.ascontiguousarray(list(ids), dtype=np.int64)
        out = np.zeros(len(ids_array), dtype=np.uint8)
        self._check(self._call("own_ids", ids_array.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), len(ids_array),
                               out.ctypes.data))
        return out.astype(bool).tolist()

    def spelling(self, token_id: int) -> str:
        raise NotImplementedError

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

    def kept(self, ids: Iterable[int], skip_special: bool) -> list[int]:
        """The ids a decode writes out: not a repeated spelling's earlier ids, nor special ones where skipped."""
        added, hidden = self.added, self.hidden_ids
        return [i for i in ids if i not in hidden and not (skip_special and added.get(i, ("", False))[1])]
