"""Sentence embeddings from a decoder LM: token ids -> final hidden states -> one pooled unit vector.

Pooling as the model says: a sentence-transformers directory names it in its Pooling module's config
(Qwen3-Embedding: the last token), a GGUF file in `{arch}.pooling_type` (llama.cpp's enum); any other
model is mean-pooled over every token. Vectors are L2-normalized, as sentence-transformers' Normalize
module and llama.cpp's server do, so a dot product is the cosine similarity. The runner call
(`LmRunner.hidden_states`) is the only model work; it must run where the runner lives (the scheduler's
worker thread), everything else here is plain tensor math.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from runlm.errors import ContextOverflowError, InvalidInputError
from runlm.runner import LmRunner, as_numpy

Pooling = Literal["mean", "last"]
POOLINGS: tuple[str, ...] = ("mean", "last")
GGUF_POOLING = {1: "mean", 3: "last"}  # llama.cpp's LLAMA_POOLING_TYPE_MEAN and _LAST
ST_POOLING = {"mean": "mean", "lasttoken": "last"}  # sentence-transformers' mode names
ST_LEGACY_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def check_pooling(pooling: str) -> Pooling:
    if pooling not in POOLINGS:
        raise InvalidInputError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return pooling  # type: ignore[return-value]


def _sentence_transformers_pooling(directory: Path) -> Pooling | None:
    """The pooling a sentence-transformers directory declares (modules.json -> its Pooling module)."""
    modules_file = directory / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        module = next(m for m in modules if str(m.get("type", "")).endswith(".Pooling"))
        config = json.loads((directory / module.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, StopIteration, AttributeError):
        return None
    mode = config.get("pooling_mode")
    if isinstance(mode, list | tuple) and len(mode) == 1:
        mode = mode[0]
    if isinstance(mode, str):
        return ST_POOLING.get(mode)  # type: ignore[return-value]
    active = [ours for key, ours in ST_LEGACY_KEYS.items() if config.get(key)]
    return active[0] if len(active) == 1 else None  # type: ignore[return-value]


def declared_pooling(path: Path, metadata: dict[str, Any]) -> Pooling:
    """The pooling a loaded model's files declare: last-token or mean (the default)."""
    if path.is_dir():
        return _sentence_transformers_pooling(path) or "mean"
    arch = metadata.get("general.architecture")
    return GGUF_POOLING.get(metadata.get(f"{arch}.pooling_type"), "mean")  # type: ignore[return-value]


def embedding_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of one input as the model's reference tokenizer makes them for a single sequence.

    The model's BOS / EOS convention (GGUF `add_eos_token`: llama.cpp's Qwen3-Embedding files set it),
    plus any special tokens a tokenizer.json post-processor appends (Qwen3-Embedding's appends
    `<|endoftext|>`, and last-token pooling reads exactly that position).
    """
    ids = tokenizer.encode(text)
    plain, full = tokenizer.encode_with_post_processor(text)
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
    tail = full[start + len(plain):] if start is not None else []
    if tail and ids[-len(tail):] != tail:
        ids += tail
    return ids


def check_embedding_input(ids: Sequence[int], vocab: int, context: int, where: str) -> None:
    """One input's ids: not empty, in the vocabulary, within the context (no room for output is needed)."""
    if not ids:
        raise InvalidInputError(f"{where}: the input is empty")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise InvalidInputError(f"{where}: token id {token!r} is outside the vocabulary [0, {vocab})")
    if len(ids) > context:
        raise ContextOverflowError(f"{where}: the input has {len(ids)} tokens but the model's context is "
                                   f"{context} tokens")


def pool(hidden: np.ndarray, pooling: Pooling) -> np.ndarray:
    """One vector from per-token hidden states [T, hidden]: their mean, or the last token's."""
    return hidden[-1] if pooling == "last" else hidden.mean(axis=0, dtype=np.float32)


def normalize(vector: np.ndarray, dimensions: int | None = None) -> np.ndarray:
    """L2-normalized (a norm under 1e-12 counts as 1e-12, as torch's normalize does), after keeping the first
    `dimensions` components (Matryoshka-style truncation)."""
    if dimensions is not None:
        if not 0 < dimensions <= vector.shape[-1]:
            raise InvalidInputError(f"dimensions must be in 1..{vector.shape[-1]} for this model, got {dimensions}")
        vector = vector[..., :dimensions]
    vector = np.asarray(vector, dtype=np.float32)
    return vector / max(float(np.linalg.norm(vector)), 1e-12)


def embed(runner: LmRunner, ids: Sequence[int], pooling: Pooling, dimensions: int | None = None) -> np.ndarray:
    """The unit embedding of one input's ids [dimensions or hidden], float32 (runs the model: call it on the
    worker)."""
    return normalize(pool(as_numpy(runner.hidden_states(ids)), pooling), dimensions)
