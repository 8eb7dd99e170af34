"""The contract is all the engine, scheduler and server need: an independent runner drives them end to end.

`ReferenceRunner` (tests/reference/reference_runner.py) wraps transformers' own model and implements only
the contract's required calls; every other behaviour comes from `LmRunner`'s defaults. On the same tiny
random weights it must give the same greedy tokens as runlm's own runner, through every layer above.
"""

from __future__ import annotations

import base64
import dataclasses
import io

import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image
from reference.reference_runner import ReferenceRunner
from reference.tiny import build_gemma3, build_llama
from reference.tiny_vision import build_gemma3_vision
from server_harness import LiveServer

from runlm import load
from runlm.engine import Engine, GenerationRequest, Scheduler
from runlm.runner import LmRunner, Session
from runlm.sampling import SamplingParams
from runlm.server import create_app

GREEDY = SamplingParams(temperature=0.0)


def prompt_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(runlm's loaded model, the reference runner) over one tiny random Llama."""
    directory = tmp_path_factory.mktemp("contract_llama")
    model = build_llama(directory)
    loaded = load(directory / "hf", dtype="f32", max_context=256)
    return loaded, ReferenceRunner(model, "llama32", context=256)


def greedy(ids: list[int], n: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=list(ids), max_tokens=n, sampling=GREEDY, ignore_eos=True)


def test_reference_runner_is_only_the_contract():
    overridden = {name for name in vars(ReferenceRunner) if not name.startswith("_")}
    assert overridden <= set(vars(LmRunner))
    assert not any(base.__name__ == "CachedRunner" for base in ReferenceRunner.__mro__)


def test_defaults_give_the_same_greedy_tokens(llama):
    loaded, reference = llama
    prompt = prompt_ids(7, seed=1)
    assert reference.generate(prompt, 10) == loaded.runner.generate(prompt, 10)
    session = reference.new_session()
    logits = reference.prefill(session, prompt)
    assert np.abs(logits - loaded.runner.predict_logits(prompt)).max() <= 1e-4
    assert reference.export(session) is None  # no snapshots: the prompt cache must never claim a hit


def test_engine_greedy_and_honest_cache_report(llama):
    loaded, reference = llama
    prompt = prompt_ids(12, seed=2)
    ours = Engine(loaded.runner, loaded.tokenizer, prompt_cache_mb=64)
    theirs = Engine(reference, loaded.tokenizer, prompt_cache_mb=64)
    for _ in range(2):  # the second time, runlm's runner reuses the cached prefix; the reference cannot
        a, b = ours.complete(greedy(prompt, 8)), theirs.complete(greedy(prompt, 8))
        assert a.token_ids == b.token_ids and a.text == b.text
    assert a.usage.cached_tokens == len(prompt) - 1
    assert b.usage.cached_tokens == 0 and theirs.prompt_cache.stats.hits == 0


def test_scheduler_batches_any_runner(llama):
    loaded, reference = llama
    batch_sizes: list[int] = []
    plain_extend_batch = reference.extend_batch

    def counting_extend_batch(sessions: list[Session], ids_lists: list[list[int]]):
        batch_sizes.append(len(sessions))
        return plain_extend_batch(sessions, ids_lists)

    reference.extend_batch = counting_extend_batch
    prompts = [prompt_ids(n, seed=10 + n) for n in (3, 9, 5, 14)]
    scheduler = Scheduler(Engine(reference, loaded.tokenizer, prompt_cache_mb=0), max_queue=8, max_batch=4)
    try:
        handles = [scheduler.submit(greedy(p, 6)) for p in prompts]
        results = [h.result() for h in handles]
    finally:
        scheduler.close()
        del reference.extend_batch
    assert [r.token_ids for r in results] == [loaded.runner.generate(p, 6) for p in prompts]
    assert max(batch_sizes) > 1  # sequences really decoded together


def test_server_and_chat_template_on_the_reference_runner(llama):
    loaded, reference = llama
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    answers = []
    for runner in (loaded.runner, reference):
        server = LiveServer(create_app(dataclasses.replace(loaded, runner=runner), model_name="tiny", api_key=""))
        try:
            client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
            streamed = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                      stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
            assert text == reply.choices[0].message.content
            answers.append((reply.choices[0].message.content, reply.usage.completion_tokens))
        finally:
            server.stop()
    assert answers[0] == answers[1] and answers[0][1] > 0


def png_data_url(width: int, height: int) -> tuple[str, bytes]:
    pixels = np.random.RandomState(5).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode(), pixels.tobytes()


def test_image_request_end_to_end_on_the_reference_runner(tmp_path_factory):
    directory = tmp_path_factory.mktemp("contract_vision")
    model, processor = build_gemma3_vision(directory)
    loaded = load(directory / "hf", dtype="f32", max_context=256)
    reference = ReferenceRunner(model, "gemma", context=256, processor=processor)
    url, rgb = png_data_url(40, 30)
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hello"}]
    answers = []
    for runner in (loaded.runner, reference):
        server = LiveServer(create_app(dataclasses.replace(loaded, runner=runner), model_name="tiny-vl", api_key=""))
        try:
            client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
            reply = client.chat.completions.create(model="tiny-vl", messages=[{"role": "user", "content": content}],
                                                   max_tokens=6, temperature=0)
            answers.append((reply.choices[0].message.content, reply.usage.prompt_tokens))
        finally:
            server.stop()
    assert answers[0] == answers[1]
    prompt = loaded.chat_template.render([{"role": "user", "content": "<start_of_image>\nhello"}])
    assert answers[1][1] == len(reference.multimodal_prompt_ids(prompt)) > 16  # the image's soft tokens count
    want = reference.generate_multimodal(prompt, rgb, 40, 30, None, 6)
    assert want == loaded.runner.generate_multimodal(prompt, rgb, 40, 30, None, 6)


def test_prompt_cache_reports_tokens_really_reused_past_the_window(tmp_path_factory):
    """Tiny Gemma, sliding window 6: a snapshot whose ring has moved past the reused prefix cannot be
    reused, and the engine says 0 cached tokens instead of claiming a hit."""
    directory = tmp_path_factory.mktemp("contract_gemma")
    build_gemma3(directory)
    loaded = load(directory / "model.gguf", dtype="f32")
    engine = Engine(loaded.runner, loaded.tokenizer, prompt_cache_mb=64)
    shared = prompt_ids(20, seed=3)  # > 3 windows
    first = engine.complete(greedy(shared + prompt_ids(10, seed=4), 4))
    assert first.usage.cached_tokens == 0
    # The stored session's ring holds only its last 6 positions; the new prompt shares 20 tokens with it.
    diverged = engine.complete(greedy(shared + prompt_ids(5, seed=5), 4))
    assert diverged.usage.cached_tokens == 0
    fresh = Engine(loaded.runner, loaded.tokenizer, prompt_cache_mb=0).complete(greedy(shared + prompt_ids(5, 5), 4))
    assert diverged.token_ids == fresh.token_ids
    # A follow-up that extends the whole stored session reuses it: the ring still covers its end.
    held = shared + prompt_ids(5, seed=5) + diverged.token_ids[:-1]  # the last sampled token was never fed
    follow = engine.complete(greedy(held + diverged.token_ids[-1:] + [7, 8, 9], 4))
    assert follow.usage.cached_tokens == len(held)
    assert engine.prompt_cache.stats.hit_tokens == len(held)


@pytest.mark.parametrize("dtype", ["f32", "auto"])
def test_swa_full_lets_the_prompt_cache_reuse_past_the_window(tmp_path_factory, dtype):
    """With the sliding-window layers keeping every position (llama.cpp's --swa-full), the prefix the ring
    had lost is reused, and the answer is the one a fresh prefill gives."""
    directory = tmp_path_factory.mktemp("contract_gemma_swa")
    reference = build_gemma3(directory)
    loaded = load(directory / ("model.gguf" if dtype == "f32" else "model-q8_0.gguf"), dtype=dtype, swa_full=True)
    engine = Engine(loaded.runner, loaded.tokenizer, prompt_cache_mb=64)
    shared = prompt_ids(20, seed=3)  # > 3 windows of the tiny Gemma
    engine.complete(greedy(shared + prompt_ids(10, seed=4), 4))
    diverged = engine.complete(greedy(shared + prompt_ids(5, seed=5), 4))
    assert diverged.usage.cached_tokens == len(shared)
    fresh = Engine(loaded.runner, loaded.tokenizer, prompt_cache_mb=0).complete(greedy(shared + prompt_ids(5, 5), 4))
    assert diverged.token_ids == fresh.token_ids
    if dtype == "f32":  # and the full cache still attends within the window, as transformers does
        ids = shared + prompt_ids(5, seed=5)
        with torch.no_grad():
            want = reference(torch.tensor([ids])).logits[0]
        session = loaded.runner.new_session()
        got = loaded.runner.extend(session, ids[:4], all_positions=True)
        steps = [loaded.runner.decode(session, t) for t in ids[4:]]
        assert np.abs(np.concatenate([got, np.stack(steps)]) - want.numpy()).max() <= 1e-4
