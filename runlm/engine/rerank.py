"""Relevance scores for a query and documents: a Qwen3-Reranker-style model's P(yes), or embedding similarity.

A Qwen3-Reranker is a causal LM asked whether a document meets a query; its score is the probability of "yes"
against "no" at the answer's first position (softmax over those two logits only), as the model card computes
it. Any other model scores by the cosine similarity of its embeddings (runlm.engine.embeddings), which ranks
but is no calibrated relevance. Model calls (`LmRunner.predict_logits`) must run on the scheduler's worker.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runlm.errors import InvalidInputError
from runlm.runner import LmRunner

RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PROMPT_HEAD = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
PROMPT_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
GGUF_POOLING_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK: what its converter writes for Qwen3-Reranker


def user_text(query: str, document: str, instruction: str | None = None) -> str:
    """The user turn of a Qwen3-Reranker prompt."""
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


def looks_like_reranker(loaded: Any) -> bool:
    """Whether a loaded model is a Qwen3-Reranker: a GGUF that declares rank pooling, or a qwen3 model whose
    `general.name`, `general.type` or file / directory name says "rerank". Names are all there is to go on:
    the reranker's weights are a plain Qwen3 causal LM."""
    meta = loaded.metadata or {}
    arch = meta.get("general.architecture")
    if arch and meta.get(f"{arch}.pooling_type") == GGUF_POOLING_RANK:
        return True
    if loaded.runner.family() != "qwen3":
        return False
    names = (meta.get("general.name"), meta.get("general.type"), meta.get("_name_or_path"), loaded.path.name)
    return any("rerank" in name.lower() for name in names if isinstance(name, str))


@dataclass(frozen=True)
class Reranker:
    """How a reranker model is asked: its "yes" and "no" token ids."""

    yes_id: int
    no_id: int

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> Reranker:
        """The reranker of a vocabulary with "yes" and "no" tokens; an error naming what is missing otherwise."""
        ids = {word: tokenizer.encode_text(word) for word in ("yes", "no")}
        missing = [word for word, found in ids.items() if len(found) != 1]
        if missing:
            raise InvalidInputError(f"this model cannot serve as a reranker: {' and '.join(map(repr, missing))} "
                                    "is not one token of its vocabulary")
        return cls(ids["yes"][0], ids["no"][0])

    def prompt_ids(self, tokenizer: Any, query: str, document: str, instruction: str | None = None) -> list[int]:
        """The prompt's ids: the template's markers are control tokens, the client's text stays text."""
        head = tokenizer.encode_prompt(PROMPT_HEAD)
        return head + tokenizer.encode_text(user_text(query, document, instruction), after_special=True) + \
            tokenizer.encode(PROMPT_TAIL, add_bos=False, add_eos=False)

    def score(self, runner: LmRunner, ids: Sequence[int]) -> float:
        """P(yes) against no at the prompt's last position (runs the model: call it on the worker)."""
        logits = runner.predict_logits(ids)
        margin = float(logits[self.yes_id]) - float(logits[self.no_id])
        if margin >= 0:  # the two-way softmax, written so that exp never overflows
            return 1.0 / (1.0 + math.exp(-margin))
        return math.exp(margin) / (1.0 + math.exp(margin))


def cosine_scores(query: np.ndarray, documents: Sequence[np.ndarray]) -> list[float]:
    """Cosine similarity of unit vectors (embeddings.embed's): their dot product."""
    return [float(np.dot(query.astype(np.float64), d.astype(np.float64))) for d in documents]
