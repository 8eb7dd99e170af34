"""`runlm bench`: runlm and its peers measured side by side, each in its own process.

Every peer gets the same token ids (tokenized once by runlm), the same thread
count, the same procedure: warm-up, timed prefill and greedy decode (repeated,
the best run counts), peak resident memory after that, then perplexity on a
fixed English text.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
import torch.nn.functional as F

from runlm import bench_worker
from runlm.catalog import resolve_model
from runlm.cluster.simulate import percentile
from runlm.engine import Engine, GenerationRequest, Scheduler
from runlm.errors import InvalidInputError, RunlmError
from runlm.formats.gguf import GGUFFile
from runlm.quant import kernels
from runlm.quant.int4 import pack_linear
from runlm.runner import as_numpy
from runlm.runtime import load
from runlm.sampling import SamplingParams
from runlm.shapes import ensure_shape
from runlm.system import cpu_name, python_command
from runlm.text import Tokenizer

PEERS = ("runlm", "runlm-torch", "runlm-f32", "llama.cpp", "transformers")
GREEDY = SamplingParams(temperature=0.0)


def english_text() -> str:
    """The GNU GPL v3: real English prose that no one here wrote, shipped with the package."""
    return resources.files("runlm").joinpath("data/GPL-3.txt").read_text()


# -- the parent: spawn workers, print the table ------------------------------------------------


def run_bench(args) -> int:
    if args.shape:  # a random-weight model at a real shape, built once and cached
        if args.model:
            raise InvalidInputError("give either -m/--model or --shape, not both")
        args.model = str(ensure_shape(args.shape, args.quant, threads=args.threads))
    if args.kernels:
        return run_kernel_bench(args)
    if args.health:
        from runlm.bench_health import run_health_bench

        return run_health_bench(args)
    if getattr(args, "replicas", None):  # through the HTTP front of N replicas on Ray Serve
        from runlm.cluster.bench import run_replica_bench  # optional: the [cluster] extra

        return run_replica_bench(args)
    if args.streams or args.prompt_cache:
        return run_engine_bench(args)

    path = resolve_model(args.model)
    threads = args.threads or os.cpu_count() or 1
    tokenizer = load_tokenizer(path)
    text_ids = tokenizer.encode(english_text())
    needed = max(args.prompt_tokens, args.ppl_tokens)
    if len(text_ids) < needed:
        text_ids = (text_ids * (needed // len(text_ids) + 1))[:needed]
    spec = {
        "path": str(path),
        "threads": threads,
        "prompt_ids": text_ids[: args.prompt_tokens],
        "gen_tokens": args.gen_tokens,
        "repeat": args.repeat,
        "ppl_ids": text_ids[: args.ppl_tokens],
        "kv_type": args.kv_type,
    }
    peers = ["runlm"] + [p for p in args.vs if p != "runlm"]
    results, skipped = [], []
    workers: list[PeerWorker] = []
    # The first use after an install or an update compiles the kernels (~30-45 s): here, so that no runlm peer's
    # timed load includes the build (the workers then load them from the cache): the native runtime's, and the
    # PyTorch extension where a peer runs on it.
    start = time.perf_counter()
    state = "ready"
    try:
        from runlm.native import library

        library.library()
    except RunlmError as exc:
        state = f"unavailable ({exc})"
    if any(peer in ("runlm-torch", "runlm-f32") for peer in peers) and not kernels.available():
        state = f"unavailable in PyTorch ({kernels.unavailable_reason()})"
    print(f"bench: runlm's kernels {state} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    for peer in peers:  # loaded one after the other: each load is timed alone
        reason = missing_peer(peer, path)
        if reason:
            skipped.append((peer, reason))
            continue
        print(f"bench: loading {peer} ...", file=sys.stderr, flush=True)
        worker = PeerWorker({**spec, "peer": peer})
        if worker.error:
            skipped.append((peer, worker.finish()["error"]))  # finish: the process reaped, its log file closed
        else:
            workers.append(worker)
    # Read bandwidth is probed before the first round and after every peer's round, so each round sits between two
    # probes: on a shared VM it moves by half within a minute, and a round is judged against the probes beside it.
    probing = path.is_file() and bool(workers)
    bandwidths: list[float] = [probe_bandwidth(threads)] if probing else []
    beside: dict[str, list[float]] = {worker.peer: [] for worker in workers}  # per peer, the mean probe per round
    for index in range(args.repeat):  # the peers take turns, round by round
        print(f"bench: round {index + 1} of {args.repeat} ...", file=sys.stderr, flush=True)
        for worker in workers:
            time.sleep(ROUND_PAUSE_S)
            worker.round()
            if probing:
                bandwidths.append(probe_bandwidth(threads))
                beside[worker.peer].append((bandwidths[-2] + bandwidths[-1]) / 2)
    for worker in workers:
        outcome = worker.finish()
        if "error" in outcome:
            skipped.append((worker.peer, outcome["error"]))
        else:
            results.append({**outcome, "round_bandwidths_gb_s": beside[worker.peer]})
    print_table(path, threads, args, results, skipped)
    limit = print_decode_limit(path, threads, results, bandwidths)
    print_memory(path, results, len(spec["prompt_ids"]) + args.gen_tokens)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"model": str(path), "threads": threads, "results": results, "skipped": skipped, "machine": machine(),
                 "decode_limit": limit, "paired": paired_with(results)},
                indent=2,
            )
        )
    return 0 if results else 1


def read_bandwidth_gbs(threads: int, megabytes: int = 1024, budget_s: float = 1.0) -> float:
    """Memory read bandwidth with `threads` threads: the fastest of repeated sums over a buffer far larger than
    any cache (a reduction is the cheapest full read torch has)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(megabytes << 18)  # float32: megabytes MiB
        seconds = best_ms(buffer.sum, budget_s) / 1e3
        return buffer.numel() * buffer.element_size() / seconds / 1e9
    finally:
        torch.set_num_threads(saved)


def weights_bytes_per_token(path: Path) -> int:
    """Bytes of weights one decode step reads: every tensor of the file, but only one row of an untied
    embedding table (a tied one is read whole as the output head). The KV cache is not counted."""
    gguf = GGUFFile(path)
    total = 0
    for name in gguf.tensor_names():
        nbytes = gguf.raw(name).data.nbytes
        if name == "token_embd.weight" and gguf.has("output.weight"):
            nbytes //= gguf.raw(name).shape[0]
        total += nbytes
    return total


def probe_bandwidth(threads: int) -> float:
    """One read-bandwidth probe between rounds, after the pause that lets the last peer's threads go idle."""
    time.sleep(ROUND_PAUSE_S)
    return read_bandwidth_gbs(threads, budget_s=0.5)


def print_decode_limit(path: Path, threads: int, results: list[dict], bandwidths: list[float]) -> dict | None:
    """Print the decode ceiling memory bandwidth sets (bytes of weights per token / read bandwidth) and each
    peer's decode rate as a share of it, two ways: the best round against the best probe (a fast minute for one and a
    slow one for the other can meet there), and each round against the probes just before and after it (the median
    over rounds: what the peer read of what the machine gave at that moment)."""
    if path.is_dir() or not results:
        return None
    bandwidth = max(bandwidths) if bandwidths else read_bandwidth_gbs(threads)
    per_token = weights_bytes_per_token(path)
    limit = bandwidth * 1e9 / per_token
    probes = f"best of {len(bandwidths)} probes, {min(bandwidths):.1f}-{bandwidth:.1f}" if len(
        bandwidths) > 1 else "one probe"
    print(f"memory read bandwidth ({threads} threads, {probes}): {bandwidth:.1f} GB/s; weights read per decoded "
          f"token: {per_token / 1e6:.0f} MB; decode limit: {limit:.1f} tok/s")
    shares = {}
    for row in results:
        rate = row["decode_tok_s"]
        share = round_shares(row, per_token)
        shares[row["peer"]] = share
        beside = "" if share is None else (f"; round by round against the probes beside each: median "
                                           f"{share['median']:.0%} ({share['min']:.0%}-{share['max']:.0%})")
        print(f"  {row['peer']}: decode {rate:.1f} tok/s = {rate / limit:.0%} of the limit{beside}")
    return {"bandwidth_gb_s": bandwidth, "bandwidth_probes_gb_s": bandwidths, "weights_bytes_per_token": per_token,
            "decode_limit_tok_s": limit, "round_shares": shares}


def round_shares(row: dict, per_token: int) -> dict | None:
    """Each round's decode rate as a share of the limit the probes beside that round set: median, min, max."""
    pairs = list(zip(row.get("rounds", []), row.get("round_bandwidths_gb_s", [])))
    if not pairs:
        return None
    return spread([r["decode_tok_s"] * per_token / (gb_s * 1e9) for r, gb_s in pairs])


def print_memory(path: Path, results: list[dict], positions: int) -> None:
    """Where each peer's peak resident memory comes from: its libraries before the model, the model loaded, the
    peak after the rounds; and the peak against the file, with the bound "file + KV cache + 150 MB" (#13's)."""
    if not path.is_file() or not results:
        return
    file_mb = path.stat().st_size / 2**20
    print(f"memory (MB): before the model (the interpreter and the peer's libraries) / loaded / peak; the file is "
          f"{file_mb:.0f}")
    for row in results:
        stages = [row.get("libraries_rss_mb"), row.get("loaded_rss_mb"), row["peak_rss_mb"]]
        shown = " / ".join("?" if mb is None else f"{mb:.0f}" for mb in stages)
        print(f"  {row['peer']}: {shown}, the peak is the file + {row['peak_rss_mb'] - file_mb:.0f}")
    kv_mb = next((row["kv_mb"] for row in results if row.get("kv_mb") is not None), None)
    if kv_mb is not None:
        print(f"  file + KV cache ({kv_mb:.0f}: runlm's caches for {positions} positions) + 150 = "
              f"{file_mb + kv_mb + 150:.0f}")


def load_tokenizer(path: Path):
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf(GGUFFile(path).metadata)


def missing_peer(peer: str, path: Path) -> str | None:
    """Why `peer` cannot run here (None when it can)."""
    module = {"llama.cpp": "llama_cpp", "transformers": "transformers"}.get(peer)
    if module and importlib.util.find_spec(module) is None:
        return f"not installed (pip install {'llama-cpp-python' if module == 'llama_cpp' else module})"
    return None


# Between two rounds: the threads of the peer that just ran may still spin-wait for work (OpenMP's and llama.cpp's
# pools poll for a while before they sleep), and must not take the cores from the next one.
ROUND_PAUSE_S = 0.5


class PeerWorker:
    """One peer measured in a process of its own that runs runlm/bench_worker.py by path (no runlm, no torch
    imported before the peer's own), kept loaded so the bench can alternate the peers' rounds."""

    def __init__(self, spec: dict):
        self.peer = spec["peer"]
        self.error: str | None = None
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
        script = f"import runpy; runpy.run_path({str(Path(bench_worker.__file__))!r}, run_name='__main__')"
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a peer's logging must not fill a pipe nobody reads
        self.proc = subprocess.Popen(python_command("-c", script), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env)
        self._ask(json.dumps(spec))

    def _ask(self, line: str) -> dict:
        """Send one line, read the JSON reply (output that is not JSON, such as a library's banner, is skipped)."""
        if self.error is None:
            try:
                self.proc.stdin.write(line + "\n")
                self.proc.stdin.flush()
                while reply := self.proc.stdout.readline():
                    if reply.startswith("{"):
                        return json.loads(reply)
            except (BrokenPipeError, OSError):
                pass
            self.stderr.seek(0)
            tail = (self.stderr.read().strip().splitlines() or ["no output"])[-1]
            self.error = f"worker failed: {tail}"
            self.proc.kill()
        return {"error": self.error}

    def round(self) -> dict:
        return self._ask("round")

    def finish(self) -> dict:
        outcome = self._ask("finish")
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self.stderr.close()
        return outcome


def machine() -> str:
    isa = kernels.isa() or "off"
    walk = f" (decode walk {kernels.decode_walk()})" if kernels.decode_walk() else ""
    return f"{cpu_name()}, {os.cpu_count()} cores, kernels {isa}{walk}, Python {platform.python_version()}"


COLUMNS = [
    ("load_s", "load s", False),
    ("prefill_tok_s", "prefill tok/s", True),
    ("decode_tok_s", "decode tok/s", True),
    ("peak_rss_mb", "peak RSS MB", False),
    ("ppl", "perplexity", False),
]


def cell(value: float | None) -> str:
    """A table figure; '-' for one not measured (perplexity with --ppl-tokens 0)."""
    return "-" if value is None else f"{value:.2f}"


def ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}x"


ROUND_KEYS = [("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")]


def paired_ratios(ours: dict, theirs: dict) -> dict | None:
    """runlm / peer for each round the two took in turn: the ratio the machine's drift cannot fake (a single
    best-of figure per peer can come from a fast minute for one and a slow one for the other)."""
    pairs = list(zip(ours.get("rounds", []), theirs.get("rounds", [])))
    if len(pairs) < 2:
        return None
    paired: dict = {"rounds": len(pairs)}
    for key, _ in ROUND_KEYS:
        paired[key] = spread([a[key] / b[key] for a, b in pairs])
    ours_gb_s, theirs_gb_s = ours.get("round_bandwidths_gb_s", []), theirs.get("round_bandwidths_gb_s", [])
    if len(ours_gb_s) == len(theirs_gb_s) == len(pairs):  # each round's decode per GB/s the machine gave beside it
        paired["decode_per_bandwidth"] = spread([a["decode_tok_s"] / ours_gb / (b["decode_tok_s"] / theirs_gb)
                                                 for (a, b), ours_gb, theirs_gb in zip(pairs, ours_gb_s, theirs_gb_s)])
    return paired


def spread(values: list[float]) -> dict:
    values = sorted(values)
    return {"median": statistics.median(values), "min": values[0], "max": values[-1]}


def paired_with(results: list[dict]) -> dict:
    """Every other peer's paired_ratios against runlm (what `runlm generate` runs; none when it was not measured)."""
    ours = next((r for r in results if r["peer"] == "runlm"), None)
    return {row["peer"]: paired_ratios(ours, row) for row in results if ours is not None and row is not ours}


def print_table(path: Path, threads: int, args, results: list[dict], skipped: list) -> None:
    print(
        f"model: {path.name}   threads: {threads}   prompt: {args.prompt_tokens}   gen: {args.gen_tokens}   "
        f"best of: {args.repeat}   "
        f"ppl tokens: {args.ppl_tokens}"
    )
    print(f"machine: {machine()}")
    header = f"| {'peer':<14} | " + " | ".join(f"{title:>13}" for _, title, _ in COLUMNS) + " |"
    print(header)
    print("|" + "|".join("-" * (len(cell) + 0) for cell in header.split("|")[1:-1]) + "|")
    for row in results:
        print(f"| {row['peer']:<14} | " + " | ".join(f"{cell(row[key]):>13}" for key, _, _ in COLUMNS) + " |")
    ours = next((r for r in results if r["peer"] == "runlm"), None)
    if ours and len(results) > 1:
        print("ratios are runlm / peer: above 1 is better for tok/s, below 1 is better for load, RSS and perplexity")
    if ours:
        for row in results:
            if row is ours:
                continue
            ratios = " | ".join(f"{ratio(ours[key], row[key]):>13}" for key, _, _ in COLUMNS)
            print(f"| {'runlm/' + row['peer']:<14} | {ratios} |")
    for peer, paired in paired_with(results).items():
        if paired:
            keys = ROUND_KEYS + ([("decode_per_bandwidth", "decode per GB/s probed beside the round")]
                                 if "decode_per_bandwidth" in paired else [])
            shown = ", ".join(f"{title} median {paired[key]['median']:.2f}x ({paired[key]['min']:.2f}x-"
                              f"{paired[key]['max']:.2f}x)" for key, title in keys)
            print(f"runlm/{peer} round by round ({paired['rounds']} alternating rounds): {shown}")
    for peer, reason in skipped:
        print(f"skipped {peer}: {reason}")


# -- the engine: continuous batching and the prompt cache ---------------------------------------


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


def run_streams(loaded, ids: list[int], count: int, gen_tokens: int) -> dict[str, float]:
    """`count` streams through the scheduler at once: aggregate and per-stream decode rate, TTFT, inter-token
    latency p50 / p99 (each stream's records timed on a thread of its own)."""
    started = time.perf_counter()
    times, _ = _timed_streams(loaded, ids, count, gen_tokens)
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    decode_window = max(t[-1] for t in times) - min(t[0] for t in times)
    return {"aggregate": sum(len(t) - 1 for t in times) / decode_window,
            "ttft": percentile([t[0] - started for t in times], 0.5),
            "itl_p50": percentile(gaps, 0.5), "itl_p99": percentile(gaps, 0.99)}


def run_long_prompt_admission(loaded, ids: list[int], streams: int, prompt_tokens: int):
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
    during = [t[k] - t[k - 1] for t, (a, b) in zip(times, windows) for k in range(a, b + 1)]
    normal = [t[k] - t[k - 1] for t, (a, b) in zip(control, windows) for k in range(a, b + 1)]
    return normal, during, first_at - admitted_at


def _timed_streams(loaded, ids: list[int], streams: int, max_tokens: int = 100_000,
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


def streamed_token_times(base_url: str, body: dict) -> list[float]:
    """Arrival time of each token of a streamed /v1/completions request (events with text).

    Read with the standard library's HTTP client, event by event: on a 2-core machine the client's CPU is
    taken from the model's threads, and httpx's line iterator cost ~420 us a token here (this loop ~110)."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise InvalidInputError(f"the server answered {response.status}: {response.read()[:500]!r}")
        arrivals: list[float] = []
        tail = b""
        while data := response.read1(1 << 16):
            now = time.perf_counter()
            *events, tail = (tail + data).split(b"\n\n")
            arrivals += [now for event in events if event.startswith(b"data: {") and b'"text": ""' not in event]
        return arrivals
    finally:
        conn.close()


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def served_process(*serve_args: str, start_timeout_s: float = 600, env: dict[str, str] | None = None) -> Iterator[str]:
    """`runlm serve SERVE_ARGS` on a free port in a process of its own, as users run it: yields its base URL
    once it listens (raises with the server's log if it dies or stays silent first), stops it afterwards. `env`:
    variables set for it on top of this process's."""
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen(python_command("-m", "runlm", "serve", *serve_args, "--port", str(port)),
                                  stdout=subprocess.DEVNULL, stderr=log, text=True, env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                log.seek(0)
                text = log.read()
                if "Uvicorn running on" in text:
                    break
                if server.poll() is not None or time.monotonic() > deadline:
                    raise InvalidInputError(f"`runlm serve` did not start: {text.strip()[-2000:]}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(timeout=30)


def run_served_vs_direct(loaded, ids: list[int], gen_tokens: int, threads: int, repeat: int = 1, dtype: str = "auto",
                         kv_type: str = "auto") -> tuple[float, float, list[float]]:
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


# -- the kernels: one matmul per weight type and shape --------------------------------------------


def best_ms(fn: Callable[[], object], budget_s: float = 0.25) -> float:
    """The fastest of repeated calls (at least 3, for up to budget_s), in ms."""
    fn()
    times: list[float] = []
    stop = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < stop and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def run_kernel_bench(args, max_rows: int = 8192) -> int:
    """For one tensor of each (type, shape) of the model: M=1 (decode) and M=17 / 128 (prefill) timings of
    runlm's kernel, a float32 GEMM on the dequantized weight, and torch's int4 kernel where it applies."""
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = GGUFFile(resolve_model(args.model))
    picked: dict[tuple[str, tuple[int, ...]], str] = {}
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        if raw.type_name in kernels.KERNEL_TYPES and len(raw.shape) == 2:
            picked.setdefault((raw.type_name, raw.shape), name)
    kernels.available()  # builds or loads the kernels, so that build_info has something to say
    print(f"model: {gguf.path.name}   threads: {torch.get_num_threads()}   kernels: {kernels.build_info()}")
    print(f"machine: {machine()}   (ms, best of repeated runs; rows capped at {max_rows})")
    print("| tensor | type | shape | M | kernel | f32 GEMM | int4 bf16 | module (path) |")
    print("|---|---|---|---|---|---|---|---|")
    for (type_name, shape), name in sorted(picked.items()):
        raw = gguf.raw(name)
        rows = min(shape[0], max_rows)
        data = np.asarray(raw.data)[:rows]
        module = kernels.GGUFLinear.from_raw(type_name, data, (rows, shape[1]), interleave=True)  # as models load it
        weight = module.dequantized()
        int4 = pack_linear(type_name, data, (rows, shape[1]), torch.bfloat16)
        for m in (1, 17, 128):
            x = torch.randn(m, shape[1])
            t_auto = best_ms(lambda: module(x))  # noqa: B023 - timed right here
            saved, module.dense_min_rows = module.dense_min_rows, 1 << 30
            t_kernel = best_ms(lambda: module(x))  # noqa: B023
            module.dense_min_rows = saved
            t_f32 = best_ms(lambda: F.linear(x, weight))  # noqa: B023
            t_int4 = f"{best_ms(lambda: int4(x.bfloat16())):.3f}" if int4 is not None else "-"  # noqa: B023
            route = "dense" if m >= saved else "kernel"
            print(f"| {name} | {type_name} | {rows}x{shape[1]} | {m} | {t_kernel:.3f} | {t_f32:.3f} | {t_int4} | "
                  f"{t_auto:.3f} ({route}) |")
    return 0


