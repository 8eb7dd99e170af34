"""One peer measured in a process of its own (`runlm bench` runs this file as a script, by path).

Kept free of torch and of the runlm package at import: a llama.cpp worker must not carry PyTorch in the
resident memory the bench reports for it, so each peer imports what it runs when it is made.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path

import numpy as np

PPL_CHUNK = 128


def status_mb(field: str) -> float | None:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM") in MiB, or None where /proc is not there."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    peak = status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float | None:
    """Resident memory now: each peer's libraries, then its loaded model."""
    return status_mb("VmRSS")


def nll_of(logits, targets) -> float:
    """Total negative log-likelihood of `targets` under rows of `logits` (log-softmax in float64)."""
    rows = np.asarray(logits, dtype=np.float64).reshape(len(targets), -1)
    top = rows.max(axis=-1, keepdims=True)
    logz = np.log(np.exp(rows - top).sum(axis=-1)) + top[:, 0]
    return float((logz - rows[np.arange(len(targets)), np.asarray(targets)]).sum())


def chunked_nll(extend_all, ids: list[int]) -> float:
    """Total negative log-likelihood of ids[1:], PPL_CHUNK tokens at a time on one KV cache: `extend_all(chunk)`
    returns every position's logits for the chunk after the ones before it."""
    total, prev = 0.0, None
    for start in range(0, len(ids), PPL_CHUNK):
        chunk = ids[start : start + PPL_CHUNK]
        logits = extend_all(chunk)
        if prev is not None:
            total += nll_of(prev[None], chunk[:1])
        total += nll_of(logits[:-1], chunk[1:])
        prev = logits[-1]
    return total


# -- one adapter per peer: load, prefill, decode step, perplexity -----------------------------


class RunlmPeer:
    """runlm.load's runner: the native runtime ("runlm", what the CLI runs), the PyTorch backend on the same
    kernels ("runlm-torch") or its float32 reference ("runlm-f32"). Only the last two import torch."""

    def __init__(self, path: str, threads: int, peer: str, kv_type: str = "auto"):
        from runlm.runtime import load

        if peer != "runlm":  # here, not at the top: the other workers must not pay for torch in their memory
            import torch  # noqa: F401
        self.libraries_rss_mb = rss_mb()
        runtime = "native" if peer == "runlm" else "torch"
        self.runner = load(path, runtime=runtime, dtype="f32" if peer == "runlm-f32" else "auto", kv_type=kv_type,
                           threads=threads).runner

    def wait_for_huge_pages(self) -> float | None:
        """Seconds the weights the load left in 4 KiB pages took to go into huge pages (runlm.native.weights.
        HugePages, a thread started by the load), waited for; None where there were none."""
        huge_pages = getattr(getattr(self.runner, "model", None), "huge_pages", None)
        return huge_pages.seconds if huge_pages is not None and huge_pages.wait() else None

    def kv_mb(self, positions: int) -> float | None:
        """What the KV caches of a session of `positions` take (runlm allocates them for the session's length)."""
        kv = self.runner.kv_bytes(positions)
        return None if kv is None else kv / 2**20

    def prefill(self, ids: list[int]) -> int:
        return int(self.runner.prefill_logits(ids).argmax())

    def decode(self, token: int) -> int:
        return int(self.runner.decode_logits(token).argmax())

    def nll(self, ids: list[int]) -> float:
        session = self.runner.new_session()
        return chunked_nll(lambda chunk: self.runner.extend(session, chunk, all_positions=True), ids)


# llama.cpp's KV cache for each --kv-type (GGML type ids; "auto" is llama.cpp's default f16). A quantized V cache
# needs its flash attention, so q8_0 turns that on.
LLAMA_CPP_KV = {"auto": {}, "f16": {}, "f32": {"type_k": 0, "type_v": 0},
                "q8_0": {"type_k": 8, "type_v": 8, "flash_attn": True}}


class LlamaCppPeer:
    def __init__(self, path: str, threads: int, n_ctx: int, kv_type: str = "auto"):
        from llama_cpp import Llama  # optional peer

        self.libraries_rss_mb = rss_mb()
        self.kv = LLAMA_CPP_KV[kv_type]
        self.llm = Llama(
            model_path=path,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=n_ctx,
            n_batch=512,
            logits_all=False,
            verbose=False,
            **self.kv,
        )
        self.path, self.threads, self.n_ctx = path, threads, n_ctx

    def _last_logits(self):
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))

    def prefill(self, ids: list[int]) -> int:
        self.llm.reset()
        self.llm.eval(ids)
        return int(self._last_logits().argmax())

    def decode(self, token: int) -> int:
        self.llm.eval([token])
        return int(self._last_logits().argmax())

    def nll(self, ids: list[int]) -> float:
        from llama_cpp import Llama  # optional peer

        del self.llm
        llm = Llama(
            model_path=self.path,
            n_threads=self.threads,
            n_ctx=self.n_ctx,
            n_batch=PPL_CHUNK,
            logits_all=True,
            verbose=False,
            **self.kv,
        )
        llm.eval(ids)
        return nll_of(llm.scores[: len(ids) - 1], ids[1:])


class TransformersPeer:
    def __init__(self, path: str, threads: int):
        import torch  # optional peer (see RunlmPeer)
        from transformers import AutoModelForCausalLM

        self.libraries_rss_mb = rss_mb()
        torch.set_num_threads(threads)
        p = Path(path)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()
        self.past = None

    def _run(self, ids: list[int]):
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([ids]), past_key_values=self.past, use_cache=True)
        self.past = out.past_key_values
        return out.logits[0]

    def prefill(self, ids: list[int]) -> int:
        self.past = None
        return int(self._run(ids)[-1].argmax())

    def decode(self, token: int) -> int:
        return int(self._run([token])[-1].argmax())

    def nll(self, ids: list[int]) -> float:
        self.past = None
        total, prev = 0.0, None
        for start in range(0, len(ids), PPL_CHUNK):
            chunk = ids[start : start + PPL_CHUNK]
            logits = self._run(chunk)
            if prev is not None:
                total += nll_of(prev[None], chunk[:1])
            total += nll_of(logits[:-1], chunk[1:])
            prev = logits[-1]
        return total


class Measured:
    """One peer, loaded in this process, measured in rounds the bench asks for one at a time: the bench
    alternates the peers' rounds, so a machine whose speed drifts (shared VMs drift 20-30% within a minute)
    slows every peer alike and each round's ratio compares like with like."""

    def __init__(self, spec: dict):
        self.spec = spec
        name, path, threads = spec["peer"], spec["path"], spec["threads"]
        prompt, gen, ppl_ids = spec["prompt_ids"], spec["gen_tokens"], spec["ppl_ids"]
        started = time.perf_counter()
        if name in ("runlm", "runlm-torch", "runlm-f32"):
            self.peer = RunlmPeer(path, threads, name, kv_type=spec.get("kv_type", "auto"))
        elif name == "llama.cpp":
            self.peer = LlamaCppPeer(path, threads, n_ctx=max(len(prompt) + gen, len(ppl_ids)) + 16,
                                     kv_type=spec.get("kv_type", "auto"))
        else:
            self.peer = TransformersPeer(path, threads)
        self.load_s = time.perf_counter() - started
        # outside the load's time, and before any round, so that no round shares the cores with that thread
        self.huge_pages_s = self.peer.wait_for_huge_pages() if isinstance(self.peer, RunlmPeer) else None
        self.loaded_rss_mb = rss_mb()
        warm = time.perf_counter()
        token = self.peer.prefill(prompt[:16])
        for _ in range(4):
            token = self.peer.decode(token)
        self.warmup_s = time.perf_counter() - warm
        self.rounds: list[dict] = []

    def round(self) -> dict:
        """One timed prefill of the prompt and greedy decode of gen_tokens after it."""
        prompt, gen = self.spec["prompt_ids"], self.spec["gen_tokens"]
        t0 = time.perf_counter()
        token = self.peer.prefill(prompt)
        t1 = time.perf_counter()
        for _ in range(gen):
            token = self.peer.decode(token)
        t2 = time.perf_counter()
        timing = {"prefill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": gen / (t2 - t1)}
        self.rounds.append(timing)
        return timing

    def finish(self) -> dict:
        """The best round, peak memory after the rounds, then perplexity."""
        if not self.rounds:
            self.round()
        rss = peak_rss_mb()
        kv_mb = getattr(self.peer, "kv_mb", None)
        positions = len(self.spec["prompt_ids"]) + self.spec["gen_tokens"]
        ppl_ids = self.spec["ppl_ids"]
        # --ppl-tokens 0 (or 1) skips perplexity: it needs one token to predict from and one predicted
        ppl = math.exp(self.peer.nll(ppl_ids) / (len(ppl_ids) - 1)) if len(ppl_ids) >= 2 else None
        return {
            "peer": self.spec["peer"],
            "load_s": self.load_s,
            "warmup_s": self.warmup_s,
            "prefill_tok_s": max(r["prefill_tok_s"] for r in self.rounds),
            "decode_tok_s": max(r["decode_tok_s"] for r in self.rounds),
            "peak_rss_mb": rss,
            "libraries_rss_mb": self.peer.libraries_rss_mb,
            "loaded_rss_mb": self.loaded_rss_mb,
            "huge_pages_s": self.huge_pages_s,
            "kv_mb": kv_mb(positions) if kv_mb else None,
            "ppl": ppl,
            "rounds": self.rounds,
        }


def serve(lines, reply) -> None:
    """The protocol with the bench: a JSON spec line, then "round" lines, then "finish"; one JSON reply a line."""
    measured = Measured(json.loads(next(lines)))
    reply({"ready": True})
    for line in lines:
        if line.strip() == "round":
            reply(measured.round())
        elif line.strip() == "finish":
            reply(measured.finish())
            return


if __name__ == "__main__":
    def reply(message: dict) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    serve(iter(sys.stdin.readline, ""), reply)
