"""POST /v1/rerank (and /rerank, /v1/reranking) on real loopback servers.

SmolLM2 is no reranker: its scores are the cosine similarities of /v1/embeddings' vectors. A tiny random-weight
Qwen3-Reranker-style directory checks the reranker path: each score is P(yes) against no, computed here from the
runner's logits on the prompt the model card writes (random weights: the order means nothing, only consistency).
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
from reference.tiny import build_qwen3_reranker
from server_harness import LiveServer

from runlm import load
from runlm.server import create_app

MODEL = "smollm2-135m"
QUERY = "How do cats sleep?"
DOCS = ["Stock markets fell sharply today.", "Cats sleep for many hours a day.", "How do cats sleep?",
        "A recipe for lemon cake."]


@pytest.fixture(scope="module")
def live(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, max_queue=4, prompt_cache_mb=0, api_key=""))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "tiny-qwen3-reranker"
    build_qwen3_reranker(directory)
    return directory


@pytest.fixture(scope="module")
def reranker(reranker_dir):
    server = LiveServer(create_app(load(reranker_dir), model_name="tiny-reranker", max_queue=4, prompt_cache_mb=0,
                                   api_key=""))
    yield server
    server.stop()


def rerank(http: httpx.Client, path: str = "/v1/rerank", **body) -> httpx.Response:
    return http.post(path, json={"model": MODEL, "query": QUERY, "documents": DOCS, **body})


def test_embedding_similarity_ranks_the_identical_document_first(http):
    r = rerank(http)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "list" and data["model"] == MODEL and data["scoring"] == "embedding-similarity"
    results = data["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
    scores = [x["relevance_score"] for x in results]
    assert scores == sorted(scores, reverse=True)
    assert results[0]["index"] == DOCS.index(QUERY) and abs(scores[0] - 1.0) < 1e-5
    assert "document" not in results[0]
    assert data["usage"]["prompt_tokens"] == data["usage"]["total_tokens"] > len(DOCS) + 1


def test_scores_are_cosines_of_the_embeddings_route(http):
    got = {x["index"]: x["relevance_score"] for x in rerank(http).json()["results"]}
    vectors = http.post("/v1/embeddings", json={"model": MODEL, "input": [QUERY, *DOCS]}).json()["data"]
    query, *docs = (np.array(v["embedding"], dtype=np.float64) for v in sorted(vectors, key=lambda v: v["index"]))
    for i, doc in enumerate(docs):
        assert abs(got[i] - float(query @ doc)) < 1e-5


def test_top_n_return_documents_object_documents_and_aliases(http):
    whole = rerank(http).json()["results"]
    documents = [{"text": d} for d in DOCS]
    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
        r = rerank(http, path, documents=documents, top_n=2, return_documents=True)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == [x["index"] for x in whole[:2]]
        assert [x["document"]["text"] for x in results] == [DOCS[x["index"]] for x in results]
    assert len(rerank(http, top_n=99).json()["results"]) == len(DOCS)


@pytest.mark.parametrize("change, param", [
    ({"documents": []}, "documents"),
    ({"documents": ["ok", 3]}, "documents"),
    ({"documents": ["ok", ""]}, "documents"),
    ({"documents": [{"text": ""}]}, "documents"),
    ({"documents": ["d"] * 1001}, "documents"),
    ({"top_n": 0}, "top_n"),
    ({"query": ""}, "query"),
    ({"query": None}, "query"),
])
def test_bad_input_is_a_400(http, change, param):
    body = {"model": MODEL, "query": QUERY, "documents": DOCS, **change}
    r = http.post("/v1/rerank", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and (error["param"] or "").startswith(param)


def test_unknown_model_is_a_404(http):
    assert rerank(http, model="other").status_code == 404


def test_too_long_a_document_is_a_400(http, smollm2_loaded):
    r = rerank(http, documents=["word " * (smollm2_loaded.context_length + 10)])
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


MODEL_CARD_PROMPT = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def test_reranker_scores_are_p_yes_of_the_runner(reranker, reranker_dir):
    reference = load(reranker_dir)
    tok = reference.tokenizer
    yes, no = tok.encode("yes", add_bos=False), tok.encode("no", add_bos=False)
    assert len(yes) == len(no) == 1
    docs = ["The quick brown fox.", "def add(a, b): return a + b", "yes no"]
    instruction = "Given a question, find the answer"
    with httpx.Client(base_url=reranker.base_url, timeout=120) as http:
        r = http.post("/rerank", json={"query": "What does the fox do?", "documents": docs,
                                       "instruction": instruction, "return_documents": True})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["scoring"] == "reranker" and data["model"] == "tiny-reranker"
    expected, tokens = {}, 0
    for i, doc in enumerate(docs):
        ids = tok.encode(MODEL_CARD_PROMPT.format(instruction=instruction, query="What does the fox do?", doc=doc))
        logits = reference.runner.predict_logits(ids).astype(np.float64)
        expected[i] = 1.0 / (1.0 + math.exp(float(logits[no[0]] - logits[yes[0]])))
        tokens += len(ids)
    got = {x["index"]: x["relevance_score"] for x in data["results"]}
    assert got.keys() == expected.keys() and all(abs(got[i] - expected[i]) < 1e-5 for i in expected)
    assert [x["index"] for x in data["results"]] == sorted(expected, key=expected.get, reverse=True)
    assert data["usage"]["prompt_tokens"] == tokens
    assert len({round(s, 6) for s in got.values()}) > 1  # the scores tell the documents apart


def test_no_reranker_option_scores_by_embeddings(reranker_dir):
    server = LiveServer(create_app(load(reranker_dir), reranker=False, max_queue=4, prompt_cache_mb=0, api_key=""))
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            data = http.post("/v1/rerank", json={"query": "the fox", "documents": ["the fox", "a b"]}).json()
        assert data["scoring"] == "embedding-similarity" and data["results"][0]["index"] == 0
    finally:
        server.stop()


def test_key_and_body_limit_guard_rerank_and_infill(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name=MODEL, api_key="secret", max_body_bytes=4096,
                                   max_queue=4, prompt_cache_mb=0))
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            body = {"query": QUERY, "documents": DOCS}
            for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/infill"):
                assert http.post(path, json=body).status_code == 401
            key = {"Authorization": "Bearer secret"}
            assert http.post("/v1/rerank", json=body, headers=key).status_code == 200
            big = {"query": QUERY, "documents": ["x" * 5000]}
            assert http.post("/v1/rerank", json=big, headers=key).status_code == 413
    finally:
        server.stop()
