"""Speculative decoding by prompt lookup (runlm.engine.speculative): the lookup and the draft pacer, and on the
native runtime, replies token for token the same with drafting on and off (greedy, sampled with a seed, under a
grammar, several sequences in one batched step), with drafts really kept; the server's per-request switch and its
usage and /metrics reports."""

from __future__ import annotations

import httpx
import pytest
from server_harness import LiveServer, openai_client

from runlm.engine import Engine, GenerationRequest
from runlm.engine.grammar import GrammarConstraint
from runlm.engine.speculative import DraftPacer, PromptLookup, Speculation
from runlm.errors import InvalidInputError
from runlm.sampling import SamplingParams
from runlm.server import create_app

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)


def diagonal(width, height):
    """The diagonal of a rectangle."""
    return (width ** 2 + height ** 2) ** 0.5
'''


def test_the_lookup_drafts_what_followed_the_longest_suffix_that_occurred_before():
    # (10, 11, 12) occurred at the start, followed by 20; (11, 12) occurred later, followed by 40: longest wins
    lookup = PromptLookup([10, 11, 12, 20, 31, 11, 12, 40, 10, 11, 12])
    assert lookup.draft(3) == [20, 31, 11]
    assert lookup.draft(0) == []
    assert PromptLookup([1, 2, 3, 4]).draft(4) == []  # nothing repeats
    grown = PromptLookup([1, 2, 3])
    grown.append(1)
    assert grown.draft(2) == []  # a lone token is not matched
    grown.append(2)
    assert grown.draft(2) == [3, 1]


def test_the_pacer_grows_drafts_that_hold_and_skips_after_refused_ones():
    pacer = DraftPacer()
    assert pacer.next_length(8) == 2
    pacer.record(2, 2)
    assert pacer.next_length(8) == 4 and pacer.next_length(3) == 3
    pacer.record(4, 1)
    assert pacer.next_length(8) == 2
    pacer.record(2, 0)  # refused at its first token: skip a step, then one-token drafts
    assert pacer.next_length(8) == 0 and pacer.next_length(8) == 1
    pacer.record(1, 0)  # refused again: skip two steps
    assert [pacer.next_length(8) for _ in range(3)] == [0, 0, 1]


@pytest.mark.parametrize("mode, draft_max", [("fast", 4), ("ngram", -1), ("ngram", 65), ("ngram", True)])
def test_bad_speculation_options_are_refused(mode, draft_max):
    with pytest.raises(InvalidInputError):
        Speculation(mode, draft_max)


def copy_prompt(loaded, name: str = "perimeter") -> list[int]:
    messages = [{"role": "user", "content": f"Repeat this code exactly, then explain {name} in one line.\n\n{CODE}"}]
    return loaded.tokenizer.encode_prompt(loaded.chat_template.render(messages, add_generation_prompt=True))


def engines(loaded) -> tuple[Engine, Engine]:
    make = lambda spec: Engine(loaded.runner, loaded.tokenizer, prompt_cache_mb=0, speculation=spec)  # noqa: E731
    return make(Speculation("off")), make(Speculation("ngram", 4))


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0),
                                      SamplingParams(temperature=0.9, top_p=0.95, seed=11),
                                      # (with a repeat penalty a reply copies little: a seed whose reply does)
                                      SamplingParams(temperature=0.7, repeat_penalty=1.2, seed=4)])
def test_replies_are_the_same_with_drafts_and_drafts_are_kept(smollm2_loaded, sampling):
    assert smollm2_loaded.runtime == "native"
    off, on = engines(smollm2_loaded)
    request = lambda: GenerationRequest(copy_prompt(smollm2_loaded), max_tokens=160,  # noqa: E731
                                        sampling=SamplingParams(**{**vars(sampling), "logprobs": True}))
    plain, drafted = off.complete(request()), on.complete(request())
    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
    assert drafted.finish_reason == plain.finish_reason
    assert [lp.logprob for lp in drafted.logprobs] == [lp.logprob for lp in plain.logprobs]
    assert plain.usage.draft_tokens == 0
    assert drafted.usage.draft_tokens > 0 and drafted.usage.accepted_tokens > 0  # the drafting path ran


def test_a_grammar_constrained_reply_is_the_same_with_drafts(smollm2_loaded):
    tok = smollm2_loaded.tokenizer
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
              "required": ["items"]}
    # the JSON to give is in the prompt, so drafts come from it whatever this build's logits make of the request
    prompt = tok.encode_prompt(smollm2_loaded.chat_template.render([{"role": "user", "content": (
        'Copy this JSON exactly: {"items": ["apple", "apple", "apple", "apple", "apple", "apple"]}')}],
        add_generation_prompt=True))
    replies = []
    for engine in engines(smollm2_loaded):
        grammar = GrammarConstraint.json_schema(schema, tok, tok.vocab_size, sorted(tok.stop_ids))
        replies.append(engine.complete(GenerationRequest(prompt, max_tokens=96, grammar=grammar,
                                                         sampling=SamplingParams(temperature=0.0))))
    assert replies[1].token_ids == replies[0].token_ids
    assert replies[1].usage.draft_tokens > 0


def run_together(engine: Engine, requests: list[GenerationRequest]) -> list[list[int]]:
    """The requests' tokens, decoded side by side in batched steps (Engine.step), as the scheduler runs them."""
    gens = [engine.new_generation(r) for r in requests]
    tokens: dict[int, list[int]] = {id(g): [] for g in gens}
    for gen in gens:
        tokens[id(gen)].append(engine.start(gen).token_id)
    active = [g for g in gens if not g.finished]
    while active:
        for gen, record in engine.step(active):
            assert not isinstance(record, Exception), record
            tokens[id(gen)].append(record.token_id)
        active = [g for g in active if not g.finished]
    return [tokens[id(g)] for g in gens]


def test_sequences_batched_beside_each_other_keep_their_replies(smollm2_loaded):
    off, on = engines(smollm2_loaded)
    prompts = [copy_prompt(smollm2_loaded, name) for name in ("area", "diagonal")]
    prompts.append(smollm2_loaded.tokenizer.encode_prompt(smollm2_loaded.chat_template.render(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True)))
    make = lambda: [GenerationRequest(p, max_tokens=96, sampling=SamplingParams(temperature=0.5, seed=i))  # noqa: E731
                    for i, p in enumerate(prompts)]
    assert run_together(on, make()) == run_together(off, make())


def test_a_sliding_window_ring_is_cut_back_only_within_its_window(gemma3_gguf):
    from runlm import load

    runner = load(gemma3_gguf).runner
    window = min(w for ring, w in zip(runner.rings, runner.windows) if ring)
    session = runner.new_session(window + 64)
    runner.extend(session, [2] + [100 + i % 50 for i in range(window - 10)])
    assert runner.can_rewind(session, 4)
    assert not runner.can_rewind(session, 40)  # past the window, new positions overwrite ones a cut would need


def test_the_server_reports_drafts_and_takes_a_per_request_switch(smollm2_loaded):
    server = LiveServer(create_app(smollm2_loaded, model_name="smollm2", speculation=Speculation("ngram", 4)))
    try:
        client = openai_client(server.base_url)
        content = f"Repeat this code exactly.\n\n{CODE}"
        ask = lambda **extra: client.chat.completions.create(  # noqa: E731
            model="smollm2", messages=[{"role": "user", "content": content}], max_tokens=96, temperature=0,
            extra_body=extra)
        drafted, plain = ask(), ask(**{"speculative.n_max": 0})
        assert drafted.choices[0].message.content == plain.choices[0].message.content
        details = drafted.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
        assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
        metrics = httpx.get(server.base_url + "/metrics").text
        kept = next(line for line in metrics.splitlines() if line.startswith("runlm_draft_accepted_tokens_total "))
        assert float(kept.split()[1]) == details.accepted_prediction_tokens
        bad = httpx.post(server.base_url + "/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "speculative.n_max": -1})
        assert bad.status_code == 400
    finally:
        server.stop()


def test_a_draft_model_drafts_and_the_reply_is_the_same(smollm2_loaded, smollm2_gguf):
    from runlm import load

    draft = load(smollm2_gguf).runner  # the model itself as its own draft: every greedy draft holds
    engine = Engine(smollm2_loaded.runner, smollm2_loaded.tokenizer, prompt_cache_mb=0,
                    speculation=Speculation("draft", 3, draft))
    off, _ = engines(smollm2_loaded)
    prompt = smollm2_loaded.tokenizer.encode_prompt(smollm2_loaded.chat_template.render(
        [{"role": "user", "content": "Name three colours and a fruit."}], add_generation_prompt=True))
    for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)):
        plain = off.complete(GenerationRequest(list(prompt), max_tokens=64, sampling=sampling))
        drafted = engine.complete(GenerationRequest(list(prompt), max_tokens=64, sampling=sampling))
        assert drafted.token_ids == plain.token_ids
        assert drafted.usage.draft_tokens > 0
    assert drafted.usage.accepted_tokens > 0
    greedy = engine.complete(GenerationRequest(list(prompt), max_tokens=64, sampling=SamplingParams(temperature=0)))
    assert greedy.usage.accepted_tokens >= 0.9 * greedy.usage.draft_tokens


def test_a_draft_model_with_another_vocabulary_is_refused(smollm2_loaded, gemma3_gguf):
    from runlm import load

    with pytest.raises(InvalidInputError, match="vocabulary"):
        Engine(smollm2_loaded.runner, smollm2_loaded.tokenizer,
               speculation=Speculation("draft", 3, load(gemma3_gguf).runner))
    with pytest.raises(InvalidInputError, match="needs a draft model"):
        Speculation("draft", 3)


def test_generate_drafts_with_a_draft_model_and_refuses_another_tokenizer(smollm2_gguf, gemma3_gguf):
    import subprocess
    import sys

    run = lambda *args: subprocess.run([sys.executable, "-m", "runlm", "generate", "-m", str(smollm2_gguf),  # noqa
                                        "--max-tokens", "24", "--stats", *args, "Count from one to ten."],
                                       capture_output=True, text=True, timeout=300)
    drafted = run("--draft-model", str(smollm2_gguf))
    assert drafted.returncode == 0, drafted.stderr[-2000:]
    assert "drafts kept" in drafted.stderr
    plain = run("--speculative", "off")
    assert plain.stdout == drafted.stdout and "no drafts" in plain.stderr
    refused = run("--draft-model", str(gemma3_gguf))
    assert refused.returncode == 1 and "tokenizer is not the model's" in refused.stderr
    assert "Traceback" not in refused.stderr
