"""`runlm bench --streams` / `--prompt-cache`: the engine's continuous batching, long-prompt admission, the prompt
cache, the routes' logits, and decode served over HTTP against the runner's own loop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from runlm.bench.common import english_text, machine, served_process, streamed_token_times
from runlm.cluster.simulate import percentile
from runlm.engine import Engine, GenerationRequest, Scheduler
from runlm.runner import ServedModel, as_numpy
from runlm.runtime import load
from runlm.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def route_logits(runner, ids: list[int], split: int, chunk: int) -> dict:
    """Logits of every position of `ids` reached five ways (whole prefill, prefill then one decode step at a
    time, prefill in chunks, decode batched beside another sequence), plus the last position after a
    prompt-cache restore ("reuse", of "reused" tokens) and after a fresh prefill ("fresh") of `ids` + one token."""
    whole = runner.extend(runner.new_session(), ids, all_positions=True)
    stepped_session = runner.new_session()
    stepped = [runner.extend(stepped_session, ids[:split], all_positions=True)]
    stepped += [runner.decode(stepped_session, t)[None] for t in ids[split:]]
    chunk_session = runner.new_session()
    chunked = [runner.extend(chunk_session, ids[i : i + chunk], all_positions=True) for i in range(0, len(ids), chunk)]
    batch_session, other = runner.new_session(), runner.new_session()
    runner.prefill(batch_session, ids[:split])
    runner.prefill(other, list(reversed(ids[:5])))
    batched = [whole[:split]]
    for i, token in enumerate(ids[split:]):
        batched.append(runner.decode_batch([other, batch_session], [ids[i % 7], token])[1:2])
    snap = runner.export(chunk_session)
    reused_session = runner.new_session()
    last, reused = runner.prefill_reusing(reused_session, ids + [ids[0]], snap, len(ids))
    fresh = runner.prefill(runner.new_session(), ids + [ids[0]])
    stack = [as_numpy(rows) for rows in (whole, *stepped)]
    return {"whole": stack[0], "stepped": np.concatenate(stack[1:]),
            "chunked": np.concatenate([as_numpy(rows) for rows in chunked]),
            "batched": np.concatenate([as_numpy(rows) for rows in batched]), "reuse": as_numpy(last)[None],
            "fresh": as_numpy(fresh)[None], "reused": reused}


def route_deviation(runner, ids: list[int]) -> float:
    """Largest |logit difference| between the routes of `route_logits` (0.0: bit-identical)."""
    got = route_logits(runner, ids, split=len(ids) // 2, chunk=max(1, len(ids) // 5))
    deltas = [float(np.abs(got[name] - got["whole"]).max()) for name in ("stepped", "chunked", "batched")]
    return max(deltas + [float(np.abs(got["reuse"] - got["fresh"]).max())])


def timed_records(handle) -> list[float]:
    """Arrival times of a request's token records (consumed on this thread)."""
    return [time.perf_counter() for record in handle if record.token_id is not None]


BURST_S = 1e-4  # records this close together came from one step (a verified draft gives several tokens at once)


def token_latencies(times: list[float]) -> list[float]:
    """Inter-token latency of tokens 1.. of a stream (its record arrival `times`): a step that gives k tokens at once
    (speculation) shares the wait before it among them, k of wait / k each, where their own gaps would read 0."""
    out = [0.0] * max(0, len(times) - 1)
    k = 1
    while k < len(times):
        end = k
        while end + 1 < len(times) and times[end + 1] - times[end] < BURST_S:
            end += 1
        share = (times[end] - times[k - 1]) / (end - k + 1)
        out[k - 1 : end] = [share] * (end - k + 1)
        k = end + 1
    return out


def run_streams(loaded: ServedModel, ids: list[int], count: int, gen_tokens: int) -> dict[str, float]:
    """`count` streams through the scheduler at once: aggregate and per-stream decode rate, TTFT, inter-token
    latency p50 / p99 (each stream's records timed on a thread of its own)."""
    started = time.perf_counter()
    times, _ = _timed_streams(loaded, ids, count, gen_tokens)
    gaps = [gap for t in times for gap in token_latencies(t)]
    decode_window = max(t[-1] for t in times) - min(t[0] for t in times)
    return {"aggregate": sum(len(t) - 1 for t in times) / decode_window,
            "ttft": percentile([t[0] - started for t in times], 0.5),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


def run_long_prompt_admission(loaded: ServedModel, ids: list[int], streams: int, prompt_tokens: int):
    """Inter-token latencies of `streams` running streams while a `prompt_tokens` prompt is admitted, the same
    streams' latencies over the same tokens in a run without it (their normal value: a stream's steps grow
    slower as its context grows, so latencies from before the admission would flatter nothing), and how long
    the admission took (seconds to the prompt's first token)."""
    long_prompt = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    windows: list[tuple[int, int]] = []  # per stream: the indices of its gaps that fell in the admission

    def admitted(scheduler: Scheduler, handles: list) -> tuple[float, float]:
        while min(h.gen.usage.completion_tokens for h in handles) < 64:  # steady state first
            time.sleep(0.01)
        admitted_at = time.perf_counter()
        long_handle = scheduler.submit(GenerationRequest(long_prompt, max_tokens=1, sampling=GREEDY,
                                                         use_prompt_cache=False))
        first_at = timed_records(long_handle)[0]
        while min(h.gen.usage.completion_tokens for h in handles) < 64 + 32:
            time.sleep(0.01)
        return admitted_at, first_at

    times, (admitted_at, first_at) = _timed_streams(loaded, ids, streams, meanwhile=admitted)
    for t in times:
        inside = [k for k in range(1, len(t)) if admitted_at <= t[k] <= first_at]
        windows.append((inside[0], inside[-1]) if inside else (1, 0))

    def unhurried(scheduler: Scheduler, handles: list) -> None:
        while any(h.gen.usage.completion_tokens <= last for h, (_, last) in zip(handles, windows)):
            time.sleep(0.01)

    control, _ = _timed_streams(loaded, ids, streams, meanwhile=unhurried)
    def in_windows(runs: list[list[float]]) -> list[float]:
        return [latency for t, (a, b) in zip(runs, windows) for latency in token_latencies(t)[a - 1 : b]]

    during, normal = in_windows(times), in_windows(control)
    return normal, during, first_at - admitted_at


def _timed_streams(loaded: ServedModel, ids: list[int], streams: int, max_tokens: int = 100_000,
                   meanwhile: Callable | None = None) -> tuple[list[list[float]], Any]:
    """`streams` greedy streams through a scheduler, their records timed on threads of their own: to their end,
    or while `meanwhile(scheduler, handles)` runs, then cancelled. (token times per stream, what it returned)"""
    engine = Engine(loaded.runner, loaded.tokenizer, context_length=loaded.context_length, prompt_cache_mb=0)
    scheduler = Scheduler(engine, max_queue=streams + 1, max_batch=streams + 1)
    try:
        handles = [scheduler.submit(GenerationRequest(ids[i * 40 : i * 40 + 32], max_tokens=max_tokens,
                                                      sampling=GREEDY, ignore_eos=True, use_prompt_cache=False))
                   for i in range(streams)]
        with ThreadPoolExecutor(streams) as pool:
            timing = [pool.submit(timed_records, h) for h in handles]
            result = None
            if meanwhile is not None:
                result = meanwhile(scheduler, handles)
                for handle in handles:
                    handle.cancel()
            return [f.result() for f in timing], result
    finally:
        scheduler.close()


def run_served_vs_direct(loaded: ServedModel, ids: list[int], gen_tokens: int, threads: int, repeat: int = 1,
                         dtype: str = "auto", kv_type: str = "auto") -> tuple[float, float, list[float]]:
    """Decode tok/s of one stream read by an HTTP client from `runlm serve` in its own process (the runner
    here, behind the server), and of the runner's own greedy loop here, on the same prompt, taken in turns `repeat`
    times: the best of each, and the ratio served / direct of each adjacent pair (a shared machine's speed drifts; a
    pair shares the drift). (A server in this process would share its GIL with the client, which no user's setup
    does.)"""
    runner = loaded.runner
    prompt = ids[:32]
    direct, served, ratios = 0.0, 0.0, []
    body = {"model": loaded.path.name, "prompt": prompt, "max_tokens": gen_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "cache_prompt": False}
    runtime = "--torch" if loaded.runtime == "torch" else "--native"
    with served_process("-m", str(loaded.path), runtime, "--threads", str(threads), "--dtype", dtype, "--kv-type",
                        kv_type, "--prompt-cache-mb", "0") as url:
        streamed_token_times(url, dict(body, max_tokens=4))  # the server's first request warms its kernels
        for _ in range(max(1, repeat)):
            marks: list[float] = []
            runner.generate(prompt, gen_tokens,
                            on_token=lambda t, marks=marks: marks.append(time.perf_counter()) or True)
            arrivals = streamed_token_times(url, body)
            pair = [(len(times) - 1) / (times[-1] - times[0]) for times in (marks, arrivals)]
            direct, served = max(direct, pair[0]), max(served, pair[1])
            ratios.append(pair[1] / pair[0])
    return served, direct, ratios


def run_engine_bench(args) -> int:
    threads = args.threads or os.cpu_count() or 1
    loaded = load(args.model, dtype=args.dtype, kv_type=args.kv_type, threads=threads)
    ids = loaded.tokenizer.encode(english_text())
    print(f"model: {loaded.path.name} ({loaded.runtime} runtime)   threads: {threads}   machine: {machine()}")
    if args.streams:
        counts = [int(n) for n in args.streams.split(",")]
        print("| streams | aggregate decode tok/s | per stream tok/s | vs 1 stream | TTFT p50 ms | ITL p50 ms | "
              "ITL p99 ms |")
        print("|---|---|---|---|---|---|---|")
        base = None
        for n in counts:  # the best of --repeat runs, as for one stream's prefill and decode
            got = max((run_streams(loaded, ids, n, args.gen_tokens) for _ in range(max(1, args.repeat))),
                      key=lambda run: run["aggregate"])
            rate = got["aggregate"]
            base = base or rate
            print(f"| {n} | {rate:.1f} | {rate / n:.1f} | {rate / base:.2f}x | {got['ttft'] * 1e3:.0f} | "
                  f"{got['itl_p50'] * 1e3:.1f} | {got['itl_p99'] * 1e3:.1f} |")
        busy = max(1, min(4, max(counts)))
        for _ in range(max(1, args.repeat)):  # every run shown: a latency tail is not a best-of figure
            normal, during, admit = run_long_prompt_admission(loaded, ids, busy, args.admit_tokens)
            p50 = [percentile(x, 0.5) * 1e3 for x in (normal, during)]
            p99 = [percentile(x, 0.99) * 1e3 for x in (normal, during)]
            print(f"a {args.admit_tokens}-token prompt admitted beside {busy} streams (its first token after "
                  f"{admit:.2f} s): their "
                  f"ITL p50 {p50[0]:.1f} -> {p50[1]:.1f} ms ({p50[1] / max(p50[0], 1e-9):.2f}x), "
                  f"p99 {p99[0]:.1f} -> {p99[1]:.1f} ms ({p99[1] / max(p99[0], 1e-9):.2f}x), against the same "
                  "tokens of the same streams without it")
        served, direct, ratios = run_served_vs_direct(loaded, ids, args.gen_tokens, threads, max(3, args.repeat),
                                                      args.dtype, args.kv_type)
        print(f"one stream served over HTTP: {served:.1f} tok/s vs the runner's own loop {direct:.1f} tok/s "
              f"(best of {len(ratios)} each: {served / direct:.0%}); served / direct in {len(ratios)} adjacent "
              f"pairs: median {float(np.median(ratios)):.0%}, {min(ratios):.0%}-{max(ratios):.0%}")
        print(f"routes (prefill / decode / chunks / batch / prompt-cache reuse): max |delta logit| "
              f"{route_deviation(loaded.runner, ids[:96]):.3g}")
    if args.prompt_cache:
        engine = Engine(loaded.runner, loaded.tokenizer, context_length=loaded.context_length, prompt_cache_mb=256)
        shared = ids[: args.prompt_tokens]
        first = engine.complete(GenerationRequest(shared + ids[600:616], max_tokens=1, sampling=GREEDY))
        second = engine.complete(GenerationRequest(shared + ids[700:716], max_tokens=1, sampling=GREEDY))
        print("| prompt cache | prompt tokens | cached | time to first token s |")
        print("|---|---|---|---|")
        print(f"| cold | {first.usage.prompt_tokens} | {first.usage.cached_tokens} | {first.usage.ttft_s:.3f} |")
        print(
            f"| shared prefix | {second.usage.prompt_tokens} | {second.usage.cached_tokens} | "
            f"{second.usage.ttft_s:.3f} |"
        )
        print(f"speed-up: {first.usage.ttft_s / max(second.usage.ttft_s, 1e-9):.1f}x")
    return 0
