"""`runlm bench`: runlm and its peers measured side by side, each in its own process.

Every peer gets the same token ids (tokenized once by runlm), the same thread
count, the same procedure: warm-up, timed prefill and greedy decode (repeated,
the best run counts), peak resident memory after that, then perplexity on a
fixed English text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from runlm.bench import worker as bench_worker
from runlm.bench.common import best_ms, english_text, load_tokenizer, machine
from runlm.catalog import resolve_model
from runlm.errors import RunlmError
from runlm.formats.gguf import GGUFFile, weights_bytes_per_token
from runlm.pytorch import kernels
from runlm.system import python_command

PEERS = ("runlm", "runlm-torch", "runlm-f32", "llama.cpp", "transformers")


def run_peer_bench(args) -> int:
    """The peers' table: load, rounds of prefill and decode in turns, memory, perplexity."""
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
    warm_page_cache(path)
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
    per_token = weights_bytes_per_token(GGUFFile(path))
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
        if row.get("huge_pages_s") is not None:
            print(f"  {row['peer']}: weights the load left in 4 KiB pages went into huge pages in "
                  f"{row['huge_pages_s']:.1f} s after it, before the rounds")
    kv_mb = next((row["kv_mb"] for row in results if row.get("kv_mb") is not None), None)
    if kv_mb is not None:
        print(f"  file + KV cache ({kv_mb:.0f}: runlm's caches for {positions} positions) + 150 = "
              f"{file_mb + kv_mb + 150:.0f}")


def warm_page_cache(path: Path, chunk: int = 16 << 20) -> int:
    """Read the model file once before any peer loads it, so every load column starts from the page cache: the first
    peer would otherwise pay the disk read alone (a 1B shape written a while before loaded in 6.6 s first against
    1.0 s second, the same bytes). The bytes read (0 where there is no file)."""
    if not path.is_file():
        return 0
    total = 0
    with open(path, "rb", buffering=0) as file:
        while data := file.read(chunk):
            total += len(data)
    return total


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
    """One peer measured in a process of its own that runs runlm/bench/worker.py by path (no runlm, no torch
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
