"""POST /v1/embeddings through the official `openai` client on a real loopback server.

SmolLM2 (mean pooling: its GGUF declares none) for the API's forms; a tiny Qwen3-Embedding-style directory
for end-to-end parity with sentence-transformers (last-token pooling, as its modules.json declares).
Tolerance: 1e-4 against the reference, 1e-6 between two routes to the same vector.
"""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest
from reference.tiny import build_qwen3_embedding
from server_harness import LiveServer

from runlm import load
from runlm.errors import InvalidInputError
from runlm.server import create_app

MODEL = "smollm2-135m"
TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply today.", "A kitten rested on the rug."]


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, max_queue=4, prompt_cache_mb=0, api_key=""))
    yield server
    server.stop()


def vectors(response) -> np.ndarray:
    return np.array([d.embedding for d in sorted(response.data, key=lambda d: d.index)], dtype=np.float64)


def test_single_input_unit_vector_and_usage(client, smollm2_loaded):
    r = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    [v] = vectors(r)
    assert v.shape == (smollm2_loaded.config.hidden_size,)
    assert abs(np.linalg.norm(v) - 1.0) < 1e-5
    assert r.model == MODEL and r.usage.prompt_tokens == r.usage.total_tokens > 3


def test_batch_equals_singles_and_ranks_similar_texts(client):
    batch = vectors(client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    singles = np.stack([vectors(client.embeddings.create(model=MODEL, input=t, encoding_format="float"))[0]
                        for t in TEXTS])
    assert np.abs(batch - singles).max() < 1e-6
    sims = batch @ batch.T
    assert sims[0, 2] > sims[0, 1]  # cat/kitten closer than cat/markets


def test_base64_default_decodes_to_the_float_vector(client):
    """The openai SDK asks for base64 unless told otherwise and decodes little-endian float32."""
    as_float = vectors(client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float"))
    as_b64 = vectors(client.embeddings.create(model=MODEL, input=TEXTS[1]))
    assert np.abs(as_float - as_b64).max() < 1e-6


def test_dimensions_truncate_and_renormalize(client):
    full = vectors(client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float"))[0]
    short = vectors(client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64,
                                             encoding_format="float"))[0]
    assert short.shape == (64,)
    assert np.abs(short - full[:64] / np.linalg.norm(full[:64])).max() < 1e-6


def test_token_id_inputs_equal_text_inputs(client, smollm2_loaded):
    ids = smollm2_loaded.tokenizer.encode(TEXTS[2])
    by_ids = vectors(client.embeddings.create(model=MODEL, input=[ids, ids[:3]], encoding_format="float"))
    by_text = vectors(client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float"))
    assert np.abs(by_ids[0] - by_text[0]).max() < 1e-6
    assert np.abs(by_ids[1] - by_ids[0]).max() > 1e-3


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], [99999999]]}, "input.1"),
    ({"input": "hi", "dimensions": 100000}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_input_is_an_openai_400(live, body, param):
    r = httpx.post(live.base_url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"] or "").startswith(param)


def test_too_long_input_and_unknown_model(client, smollm2_loaded):
    too_long = [1] * (smollm2_loaded.context_length + 1)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.embeddings.create(model=MODEL, input=[too_long])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")


def test_qwen3_embedding_style_model_matches_sentence_transformers(tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    directory = tmp_path / "qwen3-embedding"
    build_qwen3_embedding(directory)
    want = sentence_transformers.SentenceTransformer(str(directory), device="cpu").encode(TEXTS, batch_size=1)
    server = LiveServer(create_app(load(directory, dtype="f32"), model_name="tiny-embed", api_key=""))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        got = vectors(client.embeddings.create(model="tiny-embed", input=TEXTS))
        assert np.abs(got - want).max() <= 1e-4
    finally:
        server.stop()
    # --pooling overrides what the model declares.
    server = LiveServer(create_app(load(directory, dtype="f32"), model_name="tiny-embed", api_key="",
                                   pooling="mean"))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        mean = vectors(client.embeddings.create(model="tiny-embed", input=TEXTS))
        assert np.abs(mean - want).max() > 1e-2
    finally:
        server.stop()


def test_unknown_pooling_is_refused(smollm2_loaded):
    with pytest.raises(InvalidInputError, match="pooling"):
        create_app(smollm2_loaded, pooling="max")
