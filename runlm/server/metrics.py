"""Prometheus text metrics, kept by hand: a few counters and histograms need no client library."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from runlm.engine import Usage

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 5, 10, 20, 50, 100, 200, 500)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.n += 1
        self.total += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """Request counts by route and status, token counts, latency, throughput, prompt-cache hits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.finished: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.cache_hits = 0
        self.decode_seconds = 0.0
        self.prefill_seconds = 0.0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.last_tps = 0.0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.tps = _Histogram(TPS_BUCKETS)

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def observe_generation(self, usage: Usage, finish_reason: str) -> None:
        with self._lock:
            self.finished[finish_reason] += 1
            self.prompt_tokens += usage.prompt_tokens
            self.completion_tokens += usage.completion_tokens
            self.prefill_seconds += usage.prefill_s
            self.decode_seconds += usage.decode_s
            self.draft_tokens += usage.draft_tokens
            self.accepted_tokens += usage.accepted_tokens
            if usage.cached_tokens:
                self.cache_hits += 1
                self.cached_tokens += usage.cached_tokens
            if usage.completion_tokens:
                self.ttft.observe(usage.ttft_s)
            if usage.decode_tokens_per_s:
                self.last_tps = usage.decode_tokens_per_s
                self.tps.observe(usage.decode_tokens_per_s)

    def render(self, gauges: dict[str, tuple[str, float]], extra: Callable[[], list[str]] | None = None) -> str:
        """The exposition text; `gauges` maps name -> (help, value) for live values (queue depth...)."""
        with self._lock:
            lines = ["# HELP runlm_requests_total HTTP requests by route and status code.",
                     "# TYPE runlm_requests_total counter"]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f'runlm_requests_total{{route="{route}",status="{status}"}} {n}')
            lines += ["# HELP runlm_generations_total Finished generations by finish reason.",
                      "# TYPE runlm_generations_total counter"]
            for reason, n in sorted(self.finished.items()):
                lines.append(f'runlm_generations_total{{finish_reason="{reason}"}} {n}')
            counters = {
                "runlm_prompt_tokens_total": ("Prompt tokens processed (cached ones included).", self.prompt_tokens),
                "runlm_completion_tokens_total": ("Tokens generated.", self.completion_tokens),
                "runlm_prompt_cache_hits_total": ("Requests that reused a cached prompt prefix.", self.cache_hits),
                "runlm_prompt_cache_hit_tokens_total": ("Prompt tokens taken from the prompt cache.",
                                                        self.cached_tokens),
                "runlm_prefill_seconds_total": ("Seconds spent in prefill.", self.prefill_seconds),
                "runlm_decode_seconds_total": ("Seconds spent decoding.", self.decode_seconds),
                "runlm_draft_tokens_total": ("Tokens drafted by speculative decoding.", self.draft_tokens),
                "runlm_draft_accepted_tokens_total": ("Drafted tokens the model kept.", self.accepted_tokens),
            }
            for name, (help_, value) in counters.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
            lines += ["# HELP runlm_time_to_first_token_seconds Time from arrival to the first token.",
                      "# TYPE runlm_time_to_first_token_seconds histogram"]
            lines += self.ttft.lines("runlm_time_to_first_token_seconds")
            lines += ["# HELP runlm_decode_tokens_per_second Decode speed per request.",
                      "# TYPE runlm_decode_tokens_per_second histogram"]
            lines += self.tps.lines("runlm_decode_tokens_per_second")
            gauges = {"runlm_last_decode_tokens_per_second": ("Decode speed of the last request.", self.last_tps),
                      **gauges}
            for name, (help_, value) in gauges.items():
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value}"]
            if extra is not None:
                lines += extra()
        return "\n".join(lines) + "\n"


REPLICA_GAUGES = {
    "queue_depth": "Requests waiting in the replica's queue.",
    "running": "Requests the replica is generating.",
    "cache_hit_rate": "Share of the replica's prompt tokens taken from its prompt cache.",
    "decode_tokens_per_s": "The replica's decode speed (generated tokens per decode second).",
    "requests": "Requests the replica has finished.",
    "prompt_cache_bytes": "Bytes held by the replica's prompt cache.",
}


def replica_lines(reports: list[dict[str, Any]]) -> list[str]:
    """Per-replica gauges (a cluster's replicas, as they last reported), labelled by replica id."""
    if not reports:
        return []
    lines: list[str] = []
    for key, help_ in REPLICA_GAUGES.items():
        name = f"runlm_replica_{key}"
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        lines += [f'{name}{{replica="{r["replica"]}"}} {float(r.get(key, 0) or 0)}' for r in reports]
    return lines
