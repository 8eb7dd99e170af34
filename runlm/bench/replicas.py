"""`runlm bench --replicas 1,2`: aggregate decode tok/s and time to first token through the HTTP front,
for each replica count on this machine's cores (threads split between the replicas)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from runlm.bench.common import english_text, free_port, load_tokenizer, machine, streamed_token_times
from runlm.catalog import resolve_model
from runlm.cluster.deploy import ClusterOptions, ReplicaOptions, init_ray, start, stop
from runlm.cluster.simulate import percentile
from runlm.errors import InvalidInputError

PROMPT_TOKENS = 32


def stream_times(url: str, model: str, prompt: list[int], gen_tokens: int) -> tuple[float, list[float]]:
    """(send time, arrival time of each token) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": gen_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    sent = time.perf_counter()
    return sent, streamed_token_times(url, body)


def measure(url: str, model: str, prompts: list[list[int]], gen_tokens: int) -> dict[str, float]:
    stream_times(url, model, prompts[0], 4)  # warm each path once (the kernels, the router)
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda p: stream_times(url, model, p, gen_tokens), prompts))
    first_sent = min(sent for sent, _ in runs)
    last = max(times[-1] for _, times in runs)
    tokens = sum(len(times) for _, times in runs)
    ttfts = [times[0] - sent for sent, times in runs]
    return {"aggregate": tokens / (last - first_sent), "ttft_p50": percentile(ttfts, 0.5),
            "ttft_p99": percentile(ttfts, 0.99)}


def run_replica_bench(args: Any) -> int:
    counts = [int(n) for n in args.replicas.split(",")]
    if not counts or min(counts) < 1:
        raise InvalidInputError(f"--replicas takes replica counts of at least 1, got {args.replicas!r}")
    clients = int(args.streams.split(",")[-1]) if args.streams else 8
    path = resolve_model(args.model)
    threads = args.threads or os.cpu_count() or 1
    ids = load_tokenizer(path).encode(english_text())
    prompts = [ids[i * 40: i * 40 + PROMPT_TOKENS] for i in range(clients)]
    print(f"model: {path.name}   cores used: {threads}   clients: {clients}   machine: {machine()}")
    print("| replicas | threads each | aggregate tok/s | vs 1st row | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|")
    results, base = [], None
    for n in counts:
        per_replica = max(1, threads // n)
        init_ray(num_cpus=max(threads, n * per_replica), log_to_driver=False)
        try:
            url = start(ReplicaOptions(model=str(path), dtype=args.dtype, max_batch=clients, max_queue=clients),
                        ClusterOptions(replicas=n, threads_per_replica=per_replica, port=free_port()), {},
                        log_to_driver=False)
            got = measure(url, path.name, prompts, args.gen_tokens)
        finally:
            stop()
        base = base or got["aggregate"]
        results.append({"replicas": n, "threads_per_replica": per_replica, **got})
        print(f"| {n} | {per_replica} | {got['aggregate']:.1f} | {got['aggregate'] / base:.2f}x | "
              f"{got['ttft_p50'] * 1e3:.0f} | {got['ttft_p99'] * 1e3:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": str(path), "threads": threads, "clients": clients, "results": results}, f, indent=2)
    return 0
