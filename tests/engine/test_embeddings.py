"""Embeddings against references on the same weights: transformers' last hidden states (mean / last pooled,
normalized) on the tiny llama, qwen3 and gemma models, and sentence-transformers on a Qwen3-Embedding-style
directory. Tolerance: max abs difference <= 1e-4 on unit vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from reference.tiny import GEMMA_WINDOW, build_gemma3, build_llama, build_qwen3, build_qwen3_embedding

from runlm import load
from runlm.engine.embeddings import (
    check_embedding_input,
    declared_pooling,
    embed,
    embedding_ids,
    normalize,
)
from runlm.errors import ContextOverflowError, InvalidInputError, UnsupportedOperationError
from runlm.runner import LmRunner

BUILDERS = {"llama32": build_llama, "qwen3": build_qwen3, "gemma": build_gemma3}
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, BUILDERS[request.param](directory), directory


def reference_vector(model: torch.nn.Module, ids: list[int], pooling: str) -> torch.Tensor:
    """transformers' final hidden states (after the final norm), pooled and normalized."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=-1)


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_pooled_embedding_matches_transformers(tiny, fmt, pooling):
    family, reference, directory = tiny
    runner = load(directory / fmt, dtype="f32").runner
    assert runner.family() == family
    ids = torch.randint(3, 384, (2 * GEMMA_WINDOW + 5,), generator=torch.Generator().manual_seed(7)).tolist()
    got = embed(runner, ids, pooling)
    want = reference_vector(reference, ids, pooling)
    assert got.shape == (64,)
    assert np.abs(got - want.numpy()).max() <= TOL
    assert abs(np.linalg.norm(got) - 1.0) <= 1e-5


def test_hidden_states_leave_sessions_alone(tiny):
    """Embedding between decode steps must not disturb a generation in flight."""
    _, _, directory = tiny
    runner = load(directory / "hf", dtype="f32").runner
    session = _prefilled(runner, [5, 6, 7])
    alone = runner.decode(_prefilled(runner, [5, 6, 7]), 8)
    runner.hidden_states([9, 10, 11, 12])
    assert np.array_equal(runner.decode(session, 8), alone)


def _prefilled(runner: LmRunner, ids: Sequence[int]):
    session = runner.new_session()
    runner.prefill(session, ids)
    return session


def test_dimensions_truncate_then_renormalize(tiny):
    _, _, directory = tiny
    runner = load(directory / "hf", dtype="f32").runner
    ids = [5, 6, 7, 8]
    full = torch.from_numpy(runner.hidden_states(ids)).mean(dim=0)
    short = embed(runner, ids, "mean", dimensions=16)
    assert short.shape == (16,)
    assert np.abs(short - torch.nn.functional.normalize(full[:16], dim=0).numpy()).max() <= 1e-6
    with pytest.raises(InvalidInputError):
        normalize(full.numpy(), 65)


def test_sentence_transformers_qwen3_embedding(tmp_path):
    """Last-token pooling declared by modules.json, the post-processor's <|endoftext|>, Normalize."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    directory = tmp_path / "qwen3-embedding"
    build_qwen3_embedding(directory)
    loaded = load(directory, dtype="f32")
    assert loaded.family == "qwen3"
    assert declared_pooling(loaded.path, loaded.metadata) == "last"
    texts = ["The quick brown fox", "def add(a, b):\n    return a + b", "Grüße aus München!"]
    st = sentence_transformers.SentenceTransformer(str(directory), device="cpu")
    want = torch.as_tensor(st.encode(texts, convert_to_numpy=True, batch_size=1))
    end = loaded.tokenizer.token_to_id("<|endoftext|>")
    for text, expected in zip(texts, want):
        ids = embedding_ids(loaded.tokenizer, text)
        assert ids[-1] == end
        assert np.abs(embed(loaded.runner, ids, "last") - expected.numpy()).max() <= TOL


def test_declared_pooling(tmp_path):
    gguf_meta = {"general.architecture": "qwen3"}
    assert declared_pooling(tmp_path / "m.gguf", {**gguf_meta, "qwen3.pooling_type": 3}) == "last"
    assert declared_pooling(tmp_path / "m.gguf", {**gguf_meta, "qwen3.pooling_type": 1}) == "mean"
    assert declared_pooling(tmp_path / "m.gguf", gguf_meta) == "mean"
    assert declared_pooling(tmp_path, {}) == "mean"  # a directory without modules.json


def test_input_checks():
    check_embedding_input([1, 2, 3], vocab=10, context=3, where="input.0")
    with pytest.raises(InvalidInputError, match="input.1: the input is empty"):
        check_embedding_input([], vocab=10, context=3, where="input.1")
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        check_embedding_input([10], vocab=10, context=3, where="input.0")
    with pytest.raises(ContextOverflowError, match="4 tokens"):
        check_embedding_input([1, 2, 3, 4], vocab=10, context=3, where="input.0")


class LogitsOnly(LmRunner):
    def family(self) -> str:
        return "mock"

    def vocab_size(self) -> int:
        return 8

    def predict_logits(self, prompt_ids):
        return torch.zeros(8)


def test_minimal_runner_cannot_embed():
    with pytest.raises(UnsupportedOperationError, match="cannot embed"):
        LogitsOnly().hidden_states([1, 2])
