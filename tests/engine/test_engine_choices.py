"""n choices of one request: one prefill forked into n sessions, decoded side by side in the batch."""

from __future__ import annotations

import asyncio
import json

import pytest
from engine_mocks import ID, MockTokenizer, ScriptedRunner, ids

from runlm.engine import Engine, GenerationRequest, Scheduler
from runlm.engine.core import SEED_SPAN, choice_seed
from runlm.engine.grammar import GrammarConstraint
from runlm.errors import InvalidInputError
from runlm.sampling import SamplingParams

PROMPT = ids("a", "b", "c")
SCRIPT = ids("Hello", " world", "<eos>")


def engine(script=SCRIPT, **kw) -> Engine:
    return Engine(ScriptedRunner(script, **kw), MockTokenizer(), prompt_cache_mb=0)


def run_group(eng: Engine, request: GenerationRequest, n: int) -> list[list]:
    """Drive start_group and step like the scheduler does; the records of each choice."""
    gens = eng.new_choices(request, n)
    records = [[r] for r in eng.start_group(gens)]
    while not all(g.finished for g in gens):
        for gen, record in eng.step([g for g in gens if not g.finished]):
            assert not isinstance(record, Exception), record
            records[gen.index].append(record)
    return records


def test_choices_prefill_once_and_decode_as_one_batch():
    eng = engine()
    batch_sizes = []
    real = eng.runner.extend_batch

    def extend_batch(sessions, ids_lists):
        batch_sizes.append(len(sessions))
        return real(sessions, ids_lists)

    eng.runner.extend_batch = extend_batch
    records = run_group(eng, GenerationRequest(PROMPT, sampling=SamplingParams(temperature=0.0)), 3)
    assert eng.runner.prefilled_tokens == len(PROMPT)  # the prompt ran once; two sessions were restored
    assert batch_sizes == [3, 3]
    assert ["".join(r.text for r in rs) for rs in records] == ["Hello world"] * 3
    assert [{r.index for r in rs} for rs in records] == [{0}, {1}, {2}]


def test_a_runner_that_cannot_export_prefills_each_choice():
    eng = engine()
    eng.runner.export = lambda session: None
    records = run_group(eng, GenerationRequest(PROMPT, sampling=SamplingParams(temperature=0.0)), 3)
    assert eng.runner.prefilled_tokens == 3 * len(PROMPT)
    assert ["".join(r.text for r in rs) for rs in records] == ["Hello world"] * 3


def test_choice_seeds_differ_and_reproduce():
    eng = engine([ID["a"]] * 12, margin=0.0)  # no favourite: sampling draws from the noise
    request = GenerationRequest(PROMPT, max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=7))

    def tokens():
        return [[r.token_id for r in rs] for rs in run_group(eng, request, 3)]

    first = tokens()
    assert first == tokens()
    assert len({tuple(t) for t in first}) == 3
    # Choice 0 is what the same request alone gives; choice i samples as seed + i would alone.
    alone = [r.token_id for r in eng.generate(GenerationRequest(PROMPT, max_tokens=12, sampling=SamplingParams(
        temperature=1.0, seed=8)))]
    assert first[1] == alone


def test_choice_seed_wraps_into_the_generators_range():
    assert choice_seed(None, 2) is None
    assert choice_seed(5, 2) == 7
    assert choice_seed(SEED_SPAN - 1, 1) == 0
    assert choice_seed(-3, 1) == SEED_SPAN - 2  # numpy's generators take no negative seed
    with pytest.raises(InvalidInputError):
        engine().new_choices(GenerationRequest(PROMPT), 0)


def test_scheduler_group_interleaves_choices_and_sums_usage():
    eng = engine(delay_s=0.001)
    sched = Scheduler(eng, max_queue=2, max_batch=4)
    try:
        group = sched.submit_group(GenerationRequest(PROMPT, sampling=SamplingParams(temperature=0.0)), 3)
        records = list(group)
        assert sorted({r.index for r in records}) == [0, 1, 2]
        # Interleaved: every choice's first record comes before any choice's last.
        firsts = [next(i for i, r in enumerate(records) if r.index == c) for c in range(3)]
        lasts = [max(i for i, r in enumerate(records) if r.index == c) for c in range(3)]
        assert max(firsts) < min(lasts)
        usage = group.usage
        assert usage.prompt_tokens == len(PROMPT) and usage.completion_tokens == 9
        # A single request after a group still runs, and a group bigger than max_batch runs alone.
        assert sched.submit(GenerationRequest(PROMPT, sampling=SamplingParams(temperature=0.0))).result().text
        big = sched.submit_group(GenerationRequest(PROMPT, sampling=SamplingParams(temperature=0.0)), 6)
        assert [c.text for c in big.result()] == ["Hello world"] * 6
    finally:
        sched.close()


def test_scheduler_group_async_and_cancel():
    eng = engine([ID["a"]] * 200, delay_s=0.002, max_context=512)
    sched = Scheduler(eng, max_queue=2, max_batch=4)

    async def main():
        loop = asyncio.get_running_loop()
        group = sched.submit_group(GenerationRequest(PROMPT, max_tokens=200,
                                                     sampling=SamplingParams(temperature=0.0)), 2, loop=loop)
        seen = 0
        async for _record in group:
            seen += 1
            if seen == 6:
                group.cancel()
        return group

    try:
        group = asyncio.run(main())
        assert all(h.gen.finish_reason == "cancelled" for h in group.handles)
        assert sched.submit(GenerationRequest(PROMPT, max_tokens=2, sampling=SamplingParams(temperature=0.0))
                            ).result().text == "aa"
    finally:
        sched.close()


def test_each_choice_follows_a_grammar_of_its_own():
    pytest.importorskip("llguidance")
    tok = MockTokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    eng = Engine(ScriptedRunner([], margin=0.0, max_context=256), tok, prompt_cache_mb=0)
    grammar = GrammarConstraint.json_schema(schema, tok, tok.vocab_size, sorted(tok.stop_ids))
    request = GenerationRequest(tok.encode("abc"), max_tokens=60, grammar=grammar,
                                sampling=SamplingParams(temperature=1.0, seed=3))
    texts = ["".join(r.text for r in rs) for rs in run_group(eng, request, 3)]
    assert [set(json.loads(t)) for t in texts] == [{"a"}] * 3
    assert len(set(texts)) > 1  # different draws, each kept valid by its own matcher
