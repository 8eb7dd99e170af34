"""Special tokens written in message text stay text: only the chat template's own markers are control tokens.

A chat prompt is rendered from a template and client text, then tokenized as one string; a tokenizer
recognizes special-token strings anywhere in it, so a user (or a document, or a tool result) writing
`<|im_end|>\\n<|im_start|>system` would forge a system turn. `LiteralSpecials` closes that: before rendering,
every special-token string in client values is swapped for a private-use placeholder character
(`hide`), so after rendering every special-token string left is one the template wrote; `encode` then
makes those their ids and encodes the text between them with special tokens read as plain text, the
placeholders turned back into the client's original strings.

The text between two markers is encoded as the tokenizer would encode it after a special token
(`Tokenizer.encode_text`: the tokenizer's one backend, its special tokens read as text for the call and a
SentencePiece "first" prefix left off after a marker), so a prefix-space rule that applies only at the start of the
text applies exactly where it did. A prompt without forged strings gets the ids a plain `encode_prompt` gives
(tested on the real SmolLM2 and Gemma 3).
"""

from __future__ import annotations

import re
from typing import Any

from runlm.text.tokenizer import Tokenizer

PLACEHOLDER_BASE = 0xF0000  # Supplementary Private Use Area-A: 65,534 code points no tokenizer gives meaning


class LiteralSpecials:
    """Hide special-token strings in client values before rendering; encode a rendered prompt so that only
    the strings the template wrote become special tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        specials = {t.content: (i, t) for i, t in tokenizer.added_tokens().items() if t.special}
        self._ids = {text: i for text, (i, _) in specials.items()}
        texts = sorted(specials, key=len, reverse=True)  # longest first: a leftmost-longest match, as tokenizers'
        self._hide = {text: chr(PLACEHOLDER_BASE + n) for n, text in enumerate(texts)}
        self._show = {mark: text for text, mark in self._hide.items()}
        self._hide_pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._show_pattern = re.compile("|".join(map(re.escape, self._show))) if texts else None
        # a marker with lstrip / rstrip takes the whitespace beside it, as the tokenizer's extraction does
        parts = [(r"\s*" if specials[t][1].lstrip else "") + f"({re.escape(t)})" + (r"\s*" if specials[t][1].rstrip
                                                                                   else "") for t in texts]
        self._marker_pattern = re.compile("|".join(parts)) if texts else None

    def hide(self, value: Any) -> Any:
        """`value` (a string, or lists / dicts of them) with every special-token string a placeholder, in dict keys
        as in values: a tool's parameter names and a call's argument names reach the template too."""
        if self._hide_pattern is None:
            return value
        if isinstance(value, str):
            return self._hide_pattern.sub(lambda m: self._hide[m.group()], value)
        if isinstance(value, list | tuple):
            return [self.hide(v) for v in value]
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        return value

    def show(self, text: str) -> str:
        """The rendered text with the client's original strings back in place of the placeholders."""
        if self._show_pattern is None:
            return text
        return self._show_pattern.sub(lambda m: self._show[m.group()], text)

    def encode(self, rendered: str) -> list[int]:
        """Ids of a prompt rendered from `hide`n values: the template's markers special, everything else text;
        the model's BOS convention as `Tokenizer.encode_prompt` applies it."""
        if self._marker_pattern is None:
            return self.tokenizer.encode_prompt(self.show(rendered))
        ids: list[int] = []
        pos, after_marker = 0, False
        for match in self._marker_pattern.finditer(rendered):
            ids += self._text_ids(rendered[pos:match.start()], after_marker)
            ids.append(self._ids[next(g for g in match.groups() if g is not None)])
            pos, after_marker = match.end(), True
        ids += self._text_ids(rendered[pos:], after_marker)
        tok = self.tokenizer
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
        if tok.add_eos and tok.eos_id is not None:
            ids.append(tok.eos_id)
        return ids

    def _text_ids(self, text: str, after_marker: bool) -> list[int]:
        return self.tokenizer.encode_text(self.show(text), after_special=after_marker) if text else []
