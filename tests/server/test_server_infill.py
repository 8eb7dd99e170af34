"""Fill-in-the-middle on real loopback servers: llama-server's /infill, OpenAI completions' `suffix` (the official
`openai` client) and Ollama generate's `suffix` (the `ollama` client).

Neither catalog model has FIM tokens (SmolLM2's vocabulary keeps StarCoder's repo and file tokens but not its
<fim_*> ones; Gemma 3's has none), so SmolLM2 answers 400, and the FIM model is a copy of SmolLM2's file with
four unused control tokens renamed to StarCoder's <fim_prefix>, <fim_suffix>, <fim_middle>, <fim_pad> (found by
their text) and a declared tokenizer.ggml.fim_sep_token_id (its <file_sep>): both ways a file gives FIM tokens.
Its weights never learnt them, so what it writes is no infill; the tests check prompts, routes and stops.
"""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest
from formats.hostile import ARRAY, STRING, U32, GGUFImage
from server_harness import LiveServer, openai_client, scripted_server

from runlm import load
from runlm.server import create_app
from runlm.text.fim import ExtraChunk, FimTokens, infill_ids

MODEL = "smollm2-fim"
RENAMED = {"<gh_stars>": "<fim_prefix>", "<issue_start>": "<fim_suffix>", "<issue_comment>": "<fim_middle>",
           "<issue_closed>": "<fim_pad>"}
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def fim_gguf(smollm2_gguf, tmp_path_factory):
    image = GGUFImage.read(smollm2_gguf)
    _, tokens = image.get("tokenizer.ggml.tokens")
    image.set("tokenizer.ggml.tokens", ARRAY, (STRING, [RENAMED.get(t, t) for t in tokens]))
    image.set("tokenizer.ggml.fim_sep_token_id", U32, tokens.index("<file_sep>"))
    return image.write(tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf")


@pytest.fixture(scope="module")
def fim_loaded(fim_gguf):
    return load(fim_gguf)


@pytest.fixture(scope="module")
def live(fim_loaded):
    server = LiveServer(create_app(fim_loaded, model_name=MODEL, api_key="", max_queue=4, prompt_cache_mb=0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain(smollm2_loaded):
    """SmolLM2 as it ships: no FIM tokens."""
    server = LiveServer(create_app(smollm2_loaded, model_name="smollm2-135m", api_key="", max_queue=4,
                                   prompt_cache_mb=0))
    yield server
    server.stop()


def psm_ids(tok, prefix: str, suffix: str, head: str = "") -> list[int]:
    """The prompt as text with the FIM markers written in, tokenized whole: what the builder must equal."""
    return tok.encode(f"{head}<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>")


def test_fim_tokens_found_by_text_and_declared(fim_loaded, smollm2_loaded):
    tok = fim_loaded.tokenizer
    [pre], [suf], [mid], [pad] = (tok.encode(t, add_bos=False) for t in RENAMED.values())
    [rep], [sep] = tok.encode("<reponame>", add_bos=False), tok.encode("<file_sep>", add_bos=False)
    assert tok.fim == FimTokens(pre, suf, mid, pad, rep, sep, frozenset({pad, rep, sep}))
    assert smollm2_loaded.tokenizer.fim is None
    assert not {"pre", "suf", "mid"} & smollm2_loaded.tokenizer.fim_ids.keys()


def test_prompt_builder_is_psm_order(fim_loaded):
    tok = fim_loaded.tokenizer
    assert infill_ids(tok, tok.fim, PREFIX, SUFFIX) == psm_ids(tok, PREFIX, SUFFIX)
    assert infill_ids(tok, tok.fim, PREFIX, SUFFIX, prompt="return") == psm_ids(tok, PREFIX, SUFFIX) + \
        tok.encode("return", add_bos=False)
    extra = [ExtraChunk("util.py", "def sub(a, b):\n    return a - b\n")]
    head = "<reponame>myproject\n<file_sep>util.py\ndef sub(a, b):\n    return a - b\n<file_sep>filename\n"
    assert infill_ids(tok, tok.fim, PREFIX, SUFFIX, extra) == psm_ids(tok, PREFIX, SUFFIX, head)
    # client text is text: a marker written in the code does not become a control token
    ids = infill_ids(tok, tok.fim, "x = '<fim_middle>'", "")
    assert ids.count(tok.fim.mid) == 1 and ids[-1] == tok.fim.mid


def test_infill_route_prompt_and_reply(http, fim_loaded):
    tok = fim_loaded.tokenizer
    r = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8,
                                   "return_tokens": True, **GREEDY})
    assert r.status_code == 200, r.text
    data = r.json()
    ids = psm_ids(tok, PREFIX, SUFFIX)
    assert data["tokens_evaluated"] == len(ids) and data["prompt"] == tok.decode(ids)
    assert data["prompt"].index("<fim_prefix>") < data["prompt"].index("<fim_suffix>") < \
        data["prompt"].index("<fim_middle>")
    assert data["stop"] is True and data["model"] == MODEL and data["stop_type"] in ("limit", "eos")
    assert data["tokens_predicted"] == len(data["tokens"]) <= 8
    assert tok.decode(data["tokens"], skip_special=True).startswith(data["content"])


def test_infill_stream_equals_whole_and_extra_context(http, fim_loaded):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6, "prompt": "return",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}], **GREEDY}
    whole = http.post("/infill", json=body).json()
    tok = fim_loaded.tokenizer
    head = "<reponame>myproject\n<file_sep>util.py\ndef sub(a, b):\n    return a - b\n<file_sep>filename\n"
    assert whole["tokens_evaluated"] == len(psm_ids(tok, PREFIX, SUFFIX, head) + tok.encode("return", add_bos=False))
    with http.stream("POST", "/infill", json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"]


def test_openai_suffix_equals_infill(http, live, fim_loaded):
    want = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, **GREEDY})
    r = openai_client(live.base_url).completions.create(model=MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8,
                                                        temperature=0)
    assert r.choices[0].text == want.json()["content"]
    assert r.usage.prompt_tokens == len(psm_ids(fim_loaded.tokenizer, PREFIX, SUFFIX))


def test_ollama_suffix_equals_infill(http, live):
    want = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8, **GREEDY})
    client = ollama.Client(host=live.base_url, timeout=120)
    r = client.generate(model=MODEL, prompt=PREFIX, suffix=SUFFIX, stream=False,
                        options={"temperature": 0, "num_predict": 8})
    assert r.response == want.json()["content"] and r.prompt_eval_count == want.json()["tokens_evaluated"]
    parts = list(client.generate(model=MODEL, prompt=PREFIX, suffix=SUFFIX, stream=True,
                                 options={"temperature": 0, "num_predict": 8}))
    assert "".join(p.response for p in parts) == r.response


def test_generation_stops_at_fim_pad(fim_loaded):
    """A model that writes <fim_pad> has finished its middle: the reply ends there (not so in a plain completion)."""
    server = scripted_server(fim_loaded, lambda prompt, n: "x = 1<fim_pad>never", name=MODEL)
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            infill = http.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 20}).json()
            plain = http.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 20}).json()
        assert infill["content"] == "x = 1" and infill["stop_type"] == "eos"
        assert plain["choices"][0]["text"].startswith("x = 1") and "never" in plain["choices"][0]["text"]
    finally:
        server.stop()


def test_model_without_fim_tokens_is_a_400_in_each_dialect(plain):
    with httpx.Client(base_url=plain.base_url, timeout=60) as http:
        r = http.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX})
        assert r.status_code == 400
        error = r.json()["error"]
        assert "fim_pre, fim_suf, fim_mid" in error["message"] and error["code"] == "fim_not_supported"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(plain.base_url).completions.create(model="smollm2-135m", prompt=PREFIX, suffix=SUFFIX,
                                                         max_tokens=4)
    assert "fim_mid" in caught.value.body["message"]
    with pytest.raises(ollama.ResponseError) as failed:
        ollama.Client(host=plain.base_url, timeout=60).generate(model="smollm2-135m", prompt=PREFIX, suffix=SUFFIX,
                                                                stream=False)
    assert failed.value.status_code == 400 and "fill-in-the-middle" in failed.value.error


@pytest.mark.parametrize("path, body, param", [
    ("/infill", {"input_prefix": "a", "n_predict": 0}, "n_predict"),
    ("/infill", {"input_prefix": "a", "input_extra": [{"filename": 3}]}, "input_extra"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "suffix": "b", "echo": True}, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "suffix": "b"}, "prompt"),
])
def test_bad_infill_requests_are_400s(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param)
