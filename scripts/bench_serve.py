"""Servers side by side: `runlm serve` (the native runtime), `runlm serve --torch` (the PyTorch backend) and
llama-cpp-python's server on one GGUF, each in a process of its own, taking the same requests in turn: a 512-token
prompt streamed to 128 tokens (decode tok/s from the first token's arrival to the last), then four 64-token requests
at once (aggregate tok/s). Prints each server's peak resident memory (VmHWM) after the requests, and the ratios
against llama.cpp's server.

    python scripts/bench_serve.py MODEL.gguf [--threads 2] [--rounds 2]

llama-cpp-python's server needs `pip install 'llama-cpp-python[server]'`; it runs with logits_all and use_mlock off
(its defaults are on: every position's logits kept, the whole file locked in memory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from runlm.bench import english_text, free_port

PROMPT_CHARS = 2200  # ~512 tokens of English with a Llama 3 tokenizer
SERVERS = {
    "runlm": lambda model, threads, port: [sys.executable, "-m", "runlm", "serve", "-m", model, "--native",
                                           "--threads", str(threads), "--port", str(port)],
    "runlm-torch": lambda model, threads, port: [sys.executable, "-m", "runlm", "serve", "-m", model, "--torch",
                                                 "--threads", str(threads), "--port", str(port)],
    "llama.cpp": lambda model, threads, port: [sys.executable, "-m", "llama_cpp.server", "--model", model,
                                               "--n_threads", str(threads), "--n_threads_batch", str(threads),
                                               "--n_ctx", "1024", "--logits_all", "False", "--use_mlock", "False",
                                               "--port", str(port)],
}


def stream_rate(url: str, model: str, prompt: str, max_tokens: int) -> float:
    """Decode tok/s of one streamed completion: tokens after the first over the time after the first arrived."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    marks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                marks.append(time.perf_counter())
    return (len(marks) - 1) / (marks[-1] - marks[0])


def concurrent_rate(url: str, model: str, prompts: list[str], max_tokens: int) -> float:
    def one(prompt: str) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = str(Path(args.model).resolve())
    text = english_text()
    prompt = text[:PROMPT_CHARS]
    short = [text[i * 3000 : i * 3000 + 400] for i in range(1, 5)]
    results = {}
    for name, command in SERVERS.items():
        port = free_port()
        with tempfile.TemporaryFile("w+") as log:
            server = subprocess.Popen(command(model, args.threads, port), stdout=log, stderr=log, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            url = f"http://127.0.0.1:{port}"
            try:
                deadline = time.monotonic() + 600
                while True:
                    try:
                        served = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
                        break
                    except (httpx.HTTPError, KeyError, ValueError):
                        if server.poll() is not None or time.monotonic() > deadline:
                            log.seek(0)
                            print(f"{name}: did not start: {log.read()[-1500:]}", file=sys.stderr)
                            served = None
                            break
                        time.sleep(0.2)
                if served is None:
                    continue
                stream_rate(url, served, short[0], 8)  # warm-up
                decode = max(stream_rate(url, served, prompt, 128) for _ in range(args.rounds))
                together = max(concurrent_rate(url, served, short, 64) for _ in range(args.rounds))
                peak = next(int(line.split()[1]) // 1024 for line in open(f"/proc/{server.pid}/status")
                            if line.startswith("VmHWM"))
                results[name] = {"decode": decode, "four_at_once": together, "peak_mb": peak}
            finally:
                server.terminate()
                server.wait(timeout=30)
    print(f"model: {Path(model).name}   threads: {args.threads}   best of {args.rounds}")
    print("| server | decode tok/s (512-token prompt) | 4 requests at once, tok/s | peak RSS MB |")
    print("|---|---|---|---|")
    for name, row in results.items():
        print(f"| {name} | {row['decode']:.1f} | {row['four_at_once']:.1f} | {row['peak_mb']} |")
    peer = results.get("llama.cpp")
    if peer:
        for name, row in results.items():
            if name != "llama.cpp":
                print(f"{name} / llama.cpp: decode {row['decode'] / peer['decode']:.2f}x, four at once "
                      f"{row['four_at_once'] / peer['four_at_once']:.2f}x, "
                      f"peak RSS {row['peak_mb'] / peer['peak_mb']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
