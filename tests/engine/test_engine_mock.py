"""The decode loop on a scripted runner: exact streams, stops, bias, log-probs, seeds, the prompt cache."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from engine_mocks import ID, MockTokenizer, ScriptedRunner, ids

from runlm.engine import (
    Engine,
    GenerationRequest,
    PromptCache,
    QueueFullError,
    RequestHandle,
    Scheduler,
    StopStringFilter,
)
from runlm.engine.scheduler import (
    MIN_MIXED_CHUNK,
    MIXED_STEP_RATIO,
    SchedulerClosedError,
    StepPacer,
    release_openmp_pools,
)
from runlm.errors import ContextOverflowError, InvalidInputError
from runlm.runner import SessionSnapshot
from runlm.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
PROMPT = ids("a", "b", "c")


def engine(script, **kw) -> Engine:
    runner_kw = {k: v for k, v in kw.items() if k in ("delay_s", "max_context", "margin")}
    return Engine(ScriptedRunner(script, **runner_kw),
                  MockTokenizer(), prompt_cache_mb=kw.get("prompt_cache_mb", 1))


def run(eng: Engine, **kw):
    kw.setdefault("sampling", GREEDY)
    req = GenerationRequest(prompt_ids=kw.pop("prompt", PROMPT), **kw)
    return list(eng.generate(req))


def test_exact_stream_until_eos():
    records = run(engine(ids("Hello", " world", "!", "<eos>")))
    assert [r.token_id for r in records] == ids("Hello", " world", "!", "<eos>")
    assert [r.text for r in records] == ["Hello", " world", "!", ""]
    last = records[-1]
    assert last.finish_reason == "stop" and all(r.finish_reason is None for r in records[:-1])
    assert last.usage.prompt_tokens == 3 and last.usage.completion_tokens == 4


def test_end_of_turn_id_stops_and_ignore_eos_does_not():
    eng = engine(ids("Hello", "<eot>", "!", "!"))
    assert "".join(r.text for r in run(eng)) == "Hello"
    records = run(eng, ignore_eos=True, max_tokens=4)
    assert records[-1].finish_reason == "length"
    assert [r.token_id for r in records] == ids("Hello", "<eot>", "!", "!")


def test_max_tokens_gives_length():
    records = run(engine(ids("a", "b", "c", "a", "b")), max_tokens=3)
    assert len(records) == 3 and records[-1].finish_reason == "length"
    assert "".join(r.text for r in records) == "abc"


def test_stop_string_across_tokens_is_never_leaked():
    # "<|end|>" arrives as "<", "|", "end", "|>": nothing of it may reach the client.
    records = run(engine(ids("Hello", "<", "|", "end", "|>", "!")), stop=["<|end|>"])
    texts = [r.text for r in records]
    assert "".join(texts) == "Hello"
    assert records[-1].finish_reason == "stop"
    assert not any("<" in t or "|" in t for t in texts)


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    records = run(engine(ids("Hello", "<", "|", "a", "<eos>")), stop=["<|end|>"])
    texts = [r.text for r in records]
    assert texts[:4] == ["Hello", "", "", "<|a"]
    assert "".join(texts) == "Hello<|a"


def test_held_back_prefix_is_flushed_at_length():
    records = run(engine(ids("Hello", "<", "|")), stop=["<|end|>"], max_tokens=3)
    assert "".join(r.text for r in records) == "Hello<|" and records[-1].finish_reason == "length"


def test_stop_inside_one_token_cuts_the_text():
    records = run(engine(ids("Hello", " world", "!")), stop=["wor"])
    assert "".join(r.text for r in records) == "Hello " and records[-1].finish_reason == "stop"


def test_earliest_of_several_stops_wins():
    f = StopStringFilter(["STOP", "b"])
    assert f.push("aaSTObx") == ("aaSTO", True)


def test_utf8_split_over_tokens_is_not_broken():
    records = run(engine([ID["a"], 13, 14, ID["<eos>"]]))  # "€" is b"\xe2\x82" + b"\xac"
    assert [r.text for r in records] == ["a", "", "€", ""]


def test_logit_bias_bans_and_forces():
    eng = engine(ids("Hello", " world", "<eos>"))
    banned = run(eng, sampling=SamplingParams(temperature=0.0, logit_bias={ID["Hello"]: -100.0}), max_tokens=1)
    assert banned[0].token_id != ID["Hello"]
    forced = run(eng, sampling=SamplingParams(temperature=0.0, logit_bias={ID["x"]: 100.0}), max_tokens=3)
    assert [r.token_id for r in forced] == [ID["x"]] * 3


def test_logit_bias_out_of_vocab_is_invalid_input():
    with pytest.raises(InvalidInputError, match="logit_bias"):
        run(engine([0]), sampling=SamplingParams(logit_bias={10_000: 1.0}))


def test_logprobs_are_raw_log_softmax_with_alternatives():
    eng = engine(ids("Hello", "<eos>"))
    records = run(eng, sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3,
                                               logit_bias={ID["x"]: 50.0}), max_tokens=1)
    lp = records[0].logprob
    runner = eng.runner
    raw = torch.log_softmax(runner.noise[len(PROMPT)].clone().index_add_(
        0, torch.tensor([ID["Hello"]]), torch.tensor([8.0])), dim=-1)
    # The bias decided the token, but the reported numbers are the model's own.
    assert lp.token_id == ID["x"] and math.isclose(lp.logprob, float(raw[ID["x"]]), rel_tol=1e-5)
    assert [t.token_id for t in lp.top][0] == ID["Hello"] and len(lp.top) == 3
    assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob


def test_seed_makes_sampling_reproducible():
    eng = engine([], margin=0.0)
    params = dict(temperature=1.5, seed=42)

    def draw(**extra):
        return [r.token_id for r in run(eng, sampling=SamplingParams(**{**params, **extra}), max_tokens=20,
                                        ignore_eos=True)]

    a, b = draw(), draw()
    assert a == b
    assert draw(seed=43) != a


def test_context_overflow_and_max_tokens_cap():
    eng = engine([ID["a"]] * 50, max_context=8)
    with pytest.raises(ContextOverflowError, match="context"):
        run(eng, prompt=[ID["a"]] * 8)
    records = run(eng, prompt=[ID["a"]] * 5, max_tokens=100)
    assert len(records) == 3 and records[-1].finish_reason == "length"


def test_empty_prompt_and_bad_ids_are_rejected():
    eng = engine([0])
    with pytest.raises(InvalidInputError):
        run(eng, prompt=[])
    with pytest.raises(InvalidInputError):
        run(eng, prompt=[999])


def test_prompt_cache_reuses_the_longest_prefix():
    eng = engine(ids("Hello", "<eos>"), prompt_cache_mb=1)
    runner = eng.runner
    long_prompt = [ID["a"]] * 40 + ids("b")
    first = run(eng, prompt=long_prompt)
    assert runner.prefilled_tokens == 41 and first[-1].usage.cached_tokens == 0
    second = run(eng, prompt=[ID["a"]] * 40 + ids("c", "c"))
    assert second[-1].usage.cached_tokens == 40
    assert runner.prefilled_tokens == 41 + 2  # only the new suffix ran
    assert [r.token_id for r in second] == [r.token_id for r in first]
    assert eng.prompt_cache.stats.hits == 1 and eng.prompt_cache.stats.hit_tokens == 40


def test_identical_prompt_still_runs_its_last_token():
    eng = engine(ids("Hello", "<eos>"))
    run(eng)
    records = run(eng)
    assert records[-1].usage.cached_tokens == len(PROMPT) - 1


def test_prompt_cache_lru_eviction_under_budget():
    cache = PromptCache(budget_bytes=1000)

    def snap(tokens):
        return SessionSnapshot(token_ids=tokens, cache=None, nbytes=400)

    assert cache.store(snap([1, 2, 3]))
    assert cache.store(snap([4, 5, 6]))
    assert cache.lookup([1, 2, 3, 9]) == (cache._entries[0], 3)  # touch: [1,2,3] is now most recent
    assert cache.store(snap([7, 8, 9]))  # over budget: [4,5,6] (least recently used) goes
    assert cache.lookup([4, 5])[0] is None
    assert cache.lookup([1, 2])[1] == 2 and cache.lookup([7])[1] == 1
    assert cache.stats.evictions == 1
    assert not cache.store(SessionSnapshot(token_ids=[1], cache=None, nbytes=5000))  # larger than the budget


def test_prompt_cache_drops_snapshots_a_longer_one_covers():
    cache = PromptCache(budget_bytes=10_000)
    cache.store(SessionSnapshot(token_ids=[1, 2], cache=None, nbytes=10))
    cache.store(SessionSnapshot(token_ids=[1, 2, 3, 4], cache=None, nbytes=10))
    assert len(cache) == 1
    assert not cache.store(SessionSnapshot(token_ids=[1, 2, 3], cache=None, nbytes=10))
    assert len(cache) == 1


def test_prompt_cache_scopes_do_not_see_each_other():
    cache = PromptCache(budget_bytes=10_000)
    cache.store(SessionSnapshot(token_ids=[1, 2, 3], cache=None, nbytes=10), scope="a")
    assert cache.lookup([1, 2, 3, 4], scope="b") == (None, 0)
    assert cache.lookup([1, 2, 3, 4]) == (None, 0)  # the unscoped tenant is a scope of its own
    assert cache.lookup([1, 2, 3, 4], scope="a")[1] == 3
    # b's longer snapshot neither covers nor replaces a's
    assert cache.store(SessionSnapshot(token_ids=[1, 2, 3, 4], cache=None, nbytes=10), scope="b")
    assert len(cache) == 2 and cache.lookup([1, 2, 3, 4, 5], scope="a")[1] == 3


def test_engine_reuses_only_its_own_scope():
    eng = engine(ids("Hello", "<eos>"))
    run(eng, cache_scope="alice")
    other = run(eng, cache_scope="bob")
    same = run(eng, cache_scope="alice")
    assert other[-1].usage.cached_tokens == 0
    assert same[-1].usage.cached_tokens == len(PROMPT) - 1


def test_scheduler_streams_and_serialises_requests():
    eng = engine(ids("Hello", " world", "<eos>"), delay_s=0.001)
    sched = Scheduler(eng, max_queue=4)
    try:
        handles = [sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY)) for _ in range(3)]
        results = [h.result() for h in handles]
        assert [r.text for r in results] == ["Hello world"] * 3
        assert all(r.finish_reason == "stop" for r in results)
    finally:
        sched.close()


LONG_REQUEST = GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY, max_tokens=200)


def one_running(sched: Scheduler) -> RequestHandle:
    """Submit a long request and wait until the worker runs it (the one batch slot taken)."""
    running = sched.submit(LONG_REQUEST)
    deadline = time.time() + 5
    while not sched.busy and time.time() < deadline:
        time.sleep(0.001)
    return running


@pytest.fixture
def one_slot_busy():
    """A scheduler with one batch slot, held by a long request, and one queue place: (scheduler, running)."""
    sched = Scheduler(engine([ID["a"]] * 200, delay_s=0.005, max_context=512), max_queue=1, max_batch=1)
    try:
        yield sched, one_running(sched)
    finally:
        sched.close()


def test_scheduler_queue_full_and_cancel_frees_the_slot(one_slot_busy):
    sched, running = one_slot_busy
    req = LONG_REQUEST
    waiting = sched.submit(req)
    with pytest.raises(QueueFullError):
        sched.submit(req)
    waiting.cancel()
    third = sched.submit(req)  # the cancelled one no longer holds the slot
    running.cancel()
    assert running.result().finish_reason == "cancelled"
    third.cancel()
    assert third.result().finish_reason == "cancelled"


def test_planning_holds_a_queue_place_and_a_full_queue_refuses_before_planning(one_slot_busy):
    sched, running = one_slot_busy
    with sched.planning():  # the one place left is held while this request is planned
        with pytest.raises(QueueFullError):
            with sched.planning():
                pytest.fail("a request was let in to plan past a full queue")
        waiting = sched.submit(LONG_REQUEST)
    with pytest.raises(QueueFullError):  # now the place is the waiting request's
        with sched.planning():
            pytest.fail("a request was let in to plan past a full queue")
    waiting.cancel()
    with sched.planning():  # a cancelled request gives its place back
        pass
    running.cancel()
    assert running.result().finish_reason == "cancelled"


def test_step_pacer_keeps_mixed_steps_within_the_ratio_of_a_plain_step():
    pacer = StepPacer(most_rows=512)
    assert pacer.prompt_rows(4) == MIN_MIXED_CHUNK and pacer.plain_due(4)  # nothing learnt yet
    pacer.observe(4, 0, 0.050)  # the first plain step of 4 streams, cold: 50 ms
    assert pacer.plain_due(4)  # one more is taken
    pacer.observe(4, 0, 0.010)  # 10 ms: the plain time drops to it at once
    assert not pacer.plain_due(4) and pacer.decode_s[4] == 0.010
    pacer.observe(4, 4, 0.030)  # 4 prompt rows beside them: 20 ms more, 5 ms a row
    assert pacer.prompt_rows(4) == 1  # (1.6 - 1) * 10 ms / 5 ms
    for _ in range(30):  # the prompt's rows get cheap (say a short prompt now): the rows grow, doubling at most
        if pacer.plain_due(4):
            pacer.observe(4, 0, 0.010)
            continue
        before = pacer.last_rows
        rows = pacer.prompt_rows(4)
        assert rows <= 2 * before
        pacer.observe(4, rows, 0.010 + rows * 0.0001)
    assert 59 <= pacer.prompt_rows(4) <= 60  # (1.6 - 1) * 10 ms / 0.1 ms, as the averages settle
    assert 1 + pacer.prompt_rows(4) * pacer.row_s / pacer.decode_s[4] <= MIXED_STEP_RATIO
    row_s = pacer.row_s
    pacer.observe(4, 60, 0.009)  # a step with prompt rows faster than the plain one: the plain time is less
    assert pacer.decode_s[4] == 0.009 and pacer.row_s == row_s  # and the rows did not get cheaper
    assert pacer.prompt_rows(4) <= 120
    pacer.observe(4, 0, 0.019)  # a slow plain step (the machine was busy a moment) moves the plain time by 30 %
    assert pacer.decode_s[4] == pytest.approx(0.012)
    assert pacer.prompt_rows(7) == 7 and pacer.plain_due(7)  # no plain step of 7 streams seen yet
    pacer.observe(4, 0, 0.010)
    for _ in range(StepPacer.PLAIN_EVERY):  # mixed steps only: the plain step's time is due again
        assert pacer.plain_due(4) is False
        pacer.observe(4, 8, 0.011)
    assert pacer.plain_due(4)


def test_release_openmp_pools_keeps_torch_working():
    """Pausing the OpenMP runtime frees idle pools only: the next parallel op rebuilds them and computes the same."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    expected = a @ b
    assert isinstance(release_openmp_pools(), bool)
    torch.testing.assert_close(a @ b, expected)


def test_scheduler_cancel_mid_stream_stops_between_tokens():
    eng = engine([ID["a"]] * 200, delay_s=0.002, max_context=512)
    sched = Scheduler(eng, max_queue=2)
    try:
        handle = sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY, max_tokens=200))
        got = []
        for record in handle:
            got.append(record)
            if len(got) == 5:
                handle.cancel()
        assert got[-1].finish_reason == "cancelled" and len(got) < 20
        # The worker is free again.
        assert sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY, max_tokens=2)).result().text
    finally:
        sched.close()


def test_scheduler_survives_runner_errors():
    eng = engine(ids("Hello", "<eos>"))

    real_extend = eng.runner.extend

    def boom(session, ids, all_positions=False):
        if session.state is not None:  # decode steps fail
            raise RuntimeError("kernel exploded")
        return real_extend(session, ids, all_positions)

    eng.runner.extend = boom
    sched = Scheduler(eng, max_queue=2)
    try:
        with pytest.raises(RuntimeError, match="exploded"):
            sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY)).result()
        del eng.runner.extend
        assert sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY)).result().text == "Hello"
    finally:
        sched.close()


def test_a_failing_request_fails_alone_while_the_batch_goes_on():
    """One request's decode raising (batched or alone) ends that request; the others in flight finish."""
    eng = engine([ID["a"]] * 6 + ids("<eos>"), delay_s=0.002)
    poison = ID["x"]
    real_extend = eng.runner.extend

    def extend(session, ids, all_positions=False):
        if poison in session.tokens:  # this sequence's decode steps fail
            raise RuntimeError("bad sequence")
        return real_extend(session, ids, all_positions)

    eng.runner.extend = extend
    sched = Scheduler(eng, max_queue=4, max_batch=4)
    try:
        good = [sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY)) for _ in range(2)]
        bad = sched.submit(GenerationRequest(prompt_ids=PROMPT + [poison], sampling=GREEDY))
        more = sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY))
        with pytest.raises(RuntimeError, match="bad sequence"):
            bad.result()
        assert [h.result().text for h in good + [more]] == ["aaaaaa"] * 3
    finally:
        sched.close()


def test_a_sampler_failure_fails_that_request_only():
    """An exception while turning a row of logits into a token (on_logits) must not end the worker."""
    eng = engine([ID["a"]] * 4 + ids("<eos>"), delay_s=0.002)
    sched = Scheduler(eng, max_queue=4, max_batch=4)
    try:
        doomed = sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY))
        fine = sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY))

        def explode(logits):
            raise ValueError("sampler broke")

        doomed.gen.on_logits = explode
        with pytest.raises(ValueError, match="sampler broke"):
            doomed.result()
        assert fine.result().text == "aaaa"
        assert sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY)).result().text == "aaaa"
    finally:
        sched.close()


def test_scheduler_async_handles():
    import asyncio

    eng = engine(ids("Hello", " world", "<eos>"))
    sched = Scheduler(eng, max_queue=2)

    async def main():
        loop = asyncio.get_running_loop()
        handle = sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY), loop=loop)
        return await handle.aresult()

    try:
        assert asyncio.run(main()).text == "Hello world"
    finally:
        sched.close()


def test_engine_is_usable_from_one_thread_at_a_time():
    eng = engine(ids("Hello", "<eos>"))
    out = []
    t = threading.Thread(target=lambda: out.append(eng.complete(GenerationRequest(PROMPT, sampling=GREEDY))))
    t.start()
    t.join()
    assert out[0].text == "Hello" and out[0].token_ids == ids("Hello", "<eos>")


def test_scheduler_run_executes_on_the_worker_between_decode_steps():
    """Model work besides generation (embeddings) runs on the worker thread while a generation is in flight,
    and an exception in it reaches its caller without touching the generation."""
    eng = engine([ID["a"]] * 200, delay_s=0.002, max_context=512)
    sched = Scheduler(eng, max_queue=2)
    try:
        handle = sched.submit(GenerationRequest(prompt_ids=PROMPT, sampling=GREEDY, max_tokens=200))
        stream = iter(handle)
        next(stream)  # the generation has started
        on_worker = sched.run(lambda: threading.current_thread().name).result(timeout=10)
        assert on_worker == "runlm-worker" and not handle.done.is_set()
        failing = sched.run(lambda: 1 / 0)
        assert isinstance(failing.exception(timeout=10), ZeroDivisionError)
        handle.cancel()
        assert [r for r in stream][-1].finish_reason == "cancelled"
    finally:
        sched.close()
    with pytest.raises(SchedulerClosedError):
        sched.run(lambda: None)
