"""Text side of a model: tokenizer, chat template, streaming detokenizer."""

from runlm.text.chat import BUILTIN_TEMPLATES, ChatTemplate
from runlm.text.detok import StreamingDetokenizer
from runlm.text.tokenizer import EOG_TOKEN_TEXTS, Tokenizer

__all__ = ["BUILTIN_TEMPLATES", "EOG_TOKEN_TEXTS", "ChatTemplate", "StreamingDetokenizer", "Tokenizer"]
