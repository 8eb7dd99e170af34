"""Token-by-token text for streaming: only complete characters, never half of one.

A character can span tokens (an emoji as four byte-fallback tokens, a CJK character split by
byte-level BPE), so decoding each token alone would emit U+FFFD garbage. We feed each token's bytes
to an incremental UTF-8 decoder, which holds back an unfinished character: O(1) work per token.
"""

from __future__ import annotations

import codecs

from runlm.text.tokenizer import Tokenizer


class StreamingDetokenizer:
    """Turns generated token ids into text chunks whose concatenation equals `tokenizer.decode(ids)`."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False, continuation: bool = False):
        """`continuation`: the tokens continue a prompt, so the decoder's start-of-text space
        stripping does not apply (a generated " world" keeps its space)."""
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.continuation = continuation
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chunks: list[str] = []
        self._text = ""
        self._joined = 0  # how many chunks _text already holds
        self._tokens = 0  # tokens fed to the decoder (skipped specials not counted)
        mode, count = ("none", 0) if continuation else tokenizer.strip_mode
        self._strip_first_token = mode == "first_token"
        self._strip_left = count if mode == "string" else 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "" mid-character)."""
        token_id = int(token_id)
        if self.skip_special and self.tokenizer.is_special(token_id):
            return ""
        data = self.tokenizer.token_to_bytes(token_id)
        if self._tokens == 0 and self._strip_first_token and data.startswith(b" "):
            data = data[1:]  # Metaspace decoders drop the dummy-prefix space of the first token
        self._tokens += 1
        return self._emit(self._utf8.decode(data, final=False))

    def flush(self) -> str:
        """End of stream: whatever is held back (an unfinished character becomes U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True))

    def reset(self) -> None:
        """Start a new stream with the same tokenizer."""
        self.__init__(self.tokenizer, skip_special=self.skip_special, continuation=self.continuation)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if self._joined < len(self._chunks):
            self._text += "".join(self._chunks[self._joined :])
            self._joined = len(self._chunks)
        return self._text

    def _emit(self, text: str) -> str:
        # Strip decoders remove leading spaces of the whole text (the SentencePiece dummy prefix).
        while self._strip_left and text:
            if text[0] == " ":
                text = text[1:]
                self._strip_left -= 1
            else:
                self._strip_left = 0
        if text:
            self._strip_left = 0
            self._chunks.append(text)
        return text
