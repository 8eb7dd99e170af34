"""Toward internet scale, by simulation: replay a multi-turn chat trace against N simulated replicas and compare
round-robin, power-of-two choices and prefix affinity (the policies in `routing`, the code the Ray router runs).

A discrete-event simulation (one heap of timed events, no threads, no sleeping):

- Trace: conversations arrive as a Poisson process. Each opens with one of K shared system prompts, drawn with a
  Zipf popularity (a few apps send most traffic), then runs several turns; a turn's prompt is the whole history
  (system prompt, earlier user messages and replies) plus a new user message, and the user thinks for an
  exponential time after each reply. Token ids are random but fixed per conversation, so a follow-up turn's block
  hashes extend the previous turn's, as a real chat's do.
- Replica: one prompt cache (a `BlockLRU` of chained block hashes, shared prefixes held once, as a radix cache
  does) and a batch of at most `max_batch` running requests; more wait in a FIFO queue. A request is prefilled
  alone (the batch's decoding pauses meanwhile), reusing its longest cached prefix; then it decodes with the
  others, each step costing `CostModel.step_s(streams)`. Its first token comes at the end of its prefill.
- Router: the policy sees each replica's ongoing requests (queued or running) and records where each request went.

Conversations and system prompts scale with the replica count, so the load per replica stays comparable while
the pool of distinct prefixes grows, as it does when one service fronts many applications.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import accumulate
from pathlib import Path

from runlm.cluster.routing import (
    BLOCK_TOKENS,
    POLICIES,
    BlockLRU,
    PrefixAffinity,
    RoutingPolicy,
    extend_prefix_hashes,
    make_policy,
)
from runlm.errors import InvalidInputError, RunlmError


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank; 0.0 for none)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


@dataclass(frozen=True)
class CostModel:
    """What one replica's work costs. Defaults: runlm serving SmolLM2-135M Q4_1 on 2 threads (README, Benchmarks).

    - prefill_tok_s: `runlm bench -m smollm2-135m --threads 2`, prefill 1249 tok/s (512-token prompt).
    - decode_tok_s: the same table, single-stream decode 194 tok/s (the engine run measured 256; the lower,
      peer-comparable figure is used).
    - batch_speedup: `runlm bench -m smollm2-135m --threads 2 --streams 1,4,8`, 8 streams decode 2.61x one
      stream's aggregate tok/s. A step's cost is taken as linear in the streams it carries (the README's "about
      0.9 ms more per extra sequence"), fitted to 1 and `max_batch` streams; that predicts 2.12x at 4 streams, the
      bench measured 2.14x.
    - max_batch: `runlm serve --parallel` default, 8.
    - restore_s: the same bench's `--prompt-cache` rows: 512 of 528 tokens cached gave the first token after
      25 ms, of which 16 tokens at 1249 tok/s are 13 ms; the other ~12 ms (restoring the cached KV) is charged
      to every prefill that reuses a prefix.
    - prompt_cache_tokens: `runlm serve --prompt-cache-mb 256` over SmolLM2's float32 KV, 45 KiB per token (30
      layers x 3 KV heads x 64 dims x K and V x 4 bytes). Optimistic for runlm: its cache keeps whole session
      snapshots, so two conversations on one system prompt each hold a copy; the simulated cache holds it once.
    """

    prefill_tok_s: float = 1250.0
    decode_tok_s: float = 190.0
    batch_speedup: float = 2.6
    max_batch: int = 8
    restore_s: float = 0.012
    prompt_cache_tokens: int = 5825
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        for name in ("prefill_tok_s", "decode_tok_s", "batch_speedup", "max_batch", "prompt_cache_tokens",
                     "block_tokens"):
            if not getattr(self, name) > 0:
                raise InvalidInputError(f"cost model: {name} must be positive, got {getattr(self, name)}")
        if self.restore_s < 0:
            raise InvalidInputError(f"cost model: restore_s must be at least 0, got {self.restore_s}")
        if not 1 <= self.batch_speedup <= self.max_batch:
            raise InvalidInputError(f"cost model: batch_speedup must lie in [1, max_batch], got {self.batch_speedup}")
        if self.prompt_cache_tokens < self.block_tokens:
            raise InvalidInputError("cost model: the prompt cache must hold at least one block")

    def step_s(self, streams: int) -> float:
        """Seconds for one decode step over `streams` sequences (each gains one token)."""
        single = 1.0 / self.decode_tok_s
        if self.max_batch == 1:
            return single
        full = self.max_batch / (self.batch_speedup * self.decode_tok_s)
        return single + (streams - 1) * (full - single) / (self.max_batch - 1)

    def prefill_s(self, uncached_tokens: int, cached_tokens: int) -> float:
        return uncached_tokens / self.prefill_tok_s + (self.restore_s if cached_tokens else 0.0)

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        """Defaults overridden by a JSON object's keys (the field names above), e.g. measured on another machine."""
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise InvalidInputError(f"cost model {path}: {error}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(values, dict) or set(values) - known:
            unknown = sorted(set(values) - known) if isinstance(values, dict) else values
            raise InvalidInputError(f"cost model {path}: expected an object with keys among {sorted(known)}, "
                                    f"got {unknown!r}")
        return cls(**values)


@dataclass(frozen=True)
class TraceConfig:
    """The synthetic workload, per replica (token counts are drawn uniformly from the inclusive ranges)."""

    conversations_per_replica: int = 24
    arrivals_per_replica_s: float = 0.2  # conversations starting per second, per replica
    system_prompts_per_replica: float = 2.0
    zipf_exponent: float = 1.1
    system_tokens: tuple[int, int] = (256, 1024)
    turns: tuple[int, int] = (1, 8)
    user_tokens: tuple[int, int] = (16, 256)
    reply_tokens: tuple[int, int] = (32, 256)
    think_mean_s: float = 8.0

    def __post_init__(self) -> None:
        if self.conversations_per_replica < 1 or self.arrivals_per_replica_s <= 0 or self.think_mean_s < 0:
            raise InvalidInputError("trace: conversations, arrival rate and think time must be positive")
        for name in ("system_tokens", "turns", "user_tokens", "reply_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise InvalidInputError(f"trace: {name} must be a range 1 <= low <= high, got {(low, high)}")


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    reply_tokens: int
    prompt_blocks: int  # full blocks of the prompt: what the router and the cache can match
    done_blocks: int  # full blocks of prompt + reply: what the replica holds once the reply is done
    think_s: float  # the user's pause before sending this turn (0 for the first)


@dataclass(frozen=True)
class Conversation:
    start_s: float
    chain: list[int]  # block hashes of the whole conversation; a turn's prompt is a prefix of it
    turns: list[Turn]


def _token_ids(rng: random.Random, count: int) -> list[int]:
    """`count` random ids below 65536 (any fixed ids would do: only their hashes matter here)."""
    return array("H", rng.randbytes(2 * count)).tolist()


def make_trace(replicas: int, config: TraceConfig = TraceConfig(), seed: int = 0,
               block_tokens: int = BLOCK_TOKENS) -> list[Conversation]:
    """The conversations for `replicas` replicas, the same for a seed whatever the policy."""
    rng = random.Random(seed)
    prompt_count = max(1, round(config.system_prompts_per_replica * replicas))
    system_prompts = [_token_ids(rng, rng.randint(*config.system_tokens)) for _ in range(prompt_count)]
    system_chains = [extend_prefix_hashes([], tokens, block_tokens) for tokens in system_prompts]
    popularity = list(accumulate(1.0 / (rank + 1) ** config.zipf_exponent for rank in range(prompt_count)))
    rate = config.arrivals_per_replica_s * replicas
    conversations, start_s = [], 0.0
    for _ in range(config.conversations_per_replica * replicas):
        start_s += rng.expovariate(rate)
        pick = bisect_left(popularity, rng.random() * popularity[-1])
        tokens, chain = list(system_prompts[pick]), list(system_chains[pick])
        turns = []
        for turn in range(rng.randint(*config.turns)):
            tokens += _token_ids(rng, rng.randint(*config.user_tokens))
            prompt_tokens, prompt_chain = len(tokens), extend_prefix_hashes(chain, tokens, block_tokens)
            reply_tokens = rng.randint(*config.reply_tokens)
            tokens += _token_ids(rng, reply_tokens)
            chain = extend_prefix_hashes(prompt_chain, tokens, block_tokens)
            think_s = rng.expovariate(1.0 / config.think_mean_s) if turn and config.think_mean_s else 0.0
            turns.append(Turn(prompt_tokens, reply_tokens, len(prompt_chain), len(chain), think_s))
        conversations.append(Conversation(start_s, chain, turns))
    return conversations


@dataclass(frozen=True)
class RunResult:
    """One policy on one replica count."""

    replicas: int
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    busy_imbalance: float  # the busiest replica's busy time over the mean replica's
    utilization: float  # mean fraction of the run a replica was busy
    output_tok_s: float  # reply tokens over the whole run, all replicas
    duration_s: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(eq=False)
class _Request:
    conversation: Conversation
    turn: int
    arrival_s: float
    hashes: list[int] = field(default_factory=list)


class _Replica:
    """A simulated replica's state. `decoded` counts the tokens every running request has gained since the
    replica started (all running requests advance together), so a request ends when `decoded` reaches the
    value stored with it and only changes of the batch need events."""

    def __init__(self, name: str, cost: CostModel):
        self.name = name
        self.cache = BlockLRU(cost.prompt_cache_tokens // cost.block_tokens)
        self.queue: deque[_Request] = deque()
        self.running: list[tuple[float, int, _Request]] = []  # heap of (decoded at its end, tie-break, request)
        self.prefilling: _Request | None = None
        self.decoded = 0.0
        self.clock_s = 0.0
        self.busy_s = 0.0
        self.version = 0  # bumped whenever the pending end-of-decode event goes stale

    def advance(self, now_s: float, step_s: Sequence[float]) -> None:
        elapsed = now_s - self.clock_s
        if self.prefilling is not None or self.running:
            self.busy_s += elapsed
            if self.prefilling is None:
                self.decoded += elapsed / step_s[len(self.running)]
        self.clock_s = now_s


_ARRIVAL, _PREFILLED, _DECODED = 0, 1, 2


def simulate(trace: Sequence[Conversation], replicas: int, policy: RoutingPolicy,
             cost: CostModel = CostModel()) -> RunResult:
    """Run the trace through `replicas` replicas routed by `policy`."""
    if replicas < 1:
        raise InvalidInputError(f"replicas must be at least 1, got {replicas}")
    pool = [_Replica(f"r{index}", cost) for index in range(replicas)]
    by_name = {replica.name: replica for replica in pool}
    names = [replica.name for replica in pool]
    load = dict.fromkeys(names, 0)
    step_s = [0.0] + [cost.step_s(streams) for streams in range(1, cost.max_batch + 1)]
    events: list[tuple[float, int, int, object]] = []
    order = 0
    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0, "output": 0}
    last_done_s = 0.0

    def next_order() -> int:
        """A tie-break for equal times, so a seed replays exactly."""
        nonlocal order
        order += 1
        return order

    def push(at_s: float, kind: int, payload: object) -> None:
        heapq.heappush(events, (at_s, next_order(), kind, payload))

    def start_prefill(replica: _Replica, now_s: float) -> None:
        if replica.prefilling is not None or not replica.queue or len(replica.running) >= cost.max_batch:
            return
        request = replica.queue.popleft()
        turn = request.conversation.turns[request.turn]
        cached = min(replica.cache.matched(request.hashes) * cost.block_tokens, turn.prompt_tokens - 1)
        totals["prompt"] += turn.prompt_tokens
        totals["cached"] += cached
        replica.prefilling = request
        replica.version += 1  # the pending end-of-decode event is stale: decoding pauses during the prefill
        push(now_s + cost.prefill_s(turn.prompt_tokens - cached, cached), _PREFILLED, replica)

    def schedule_decode(replica: _Replica, now_s: float) -> None:
        replica.version += 1
        if replica.prefilling is None and replica.running:
            tokens_left = replica.running[0][0] - replica.decoded
            push(now_s + tokens_left * step_s[len(replica.running)], _DECODED, (replica, replica.version))

    def finish(replica: _Replica, request: _Request, now_s: float) -> None:
        nonlocal last_done_s
        conversation, turn = request.conversation, request.conversation.turns[request.turn]
        replica.cache.touch(conversation.chain[:turn.done_blocks])
        load[replica.name] -= 1
        totals["output"] += turn.reply_tokens
        last_done_s = now_s
        if request.turn + 1 < len(conversation.turns):
            follow_up = conversation.turns[request.turn + 1]
            arrival_s = now_s + follow_up.think_s
            push(arrival_s, _ARRIVAL, _Request(conversation, request.turn + 1, arrival_s))

    for conversation in trace:
        push(conversation.start_s, _ARRIVAL, _Request(conversation, 0, conversation.start_s))
    while events:
        now_s, _, kind, payload = heapq.heappop(events)
        if kind == _ARRIVAL:
            request = payload
            turn = request.conversation.turns[request.turn]
            request.hashes = request.conversation.chain[:turn.prompt_blocks]
            name = policy.choose(request.hashes, names, load)
            policy.record(request.hashes, name)
            load[name] += 1
            replica = by_name[name]
            replica.advance(now_s, step_s)
            replica.queue.append(request)
            start_prefill(replica, now_s)  # a running batch's pending end-of-decode event stays valid otherwise
            continue
        if kind == _PREFILLED:
            replica = payload
            replica.advance(now_s, step_s)
            request, replica.prefilling = replica.prefilling, None
            ttfts.append(now_s - request.arrival_s)
            replica.cache.touch(request.hashes)
            tokens_left = request.conversation.turns[request.turn].reply_tokens - 1
            if tokens_left > 0:
                heapq.heappush(replica.running, (replica.decoded + tokens_left, next_order(), request))
            else:
                finish(replica, request, now_s)
        else:
            replica, version = payload
            if version != replica.version:
                continue
            replica.advance(now_s, step_s)
            while replica.running and replica.running[0][0] <= replica.decoded + 1e-6:
                finish(replica, heapq.heappop(replica.running)[2], now_s)
        start_prefill(replica, now_s)
        schedule_decode(replica, now_s)

    first_s = trace[0].start_s if trace else 0.0
    duration_s = max(last_done_s - first_s, 1e-9)
    for replica in pool:
        replica.advance(last_done_s, step_s)
    busy = [replica.busy_s for replica in pool]
    mean_busy = sum(busy) / len(busy)
    return RunResult(
        replicas=replicas, policy=policy.name, requests=len(ttfts), prompt_tokens=totals["prompt"],
        cached_tokens=totals["cached"], ttft_p50_s=percentile(ttfts, 0.5), ttft_p99_s=percentile(ttfts, 0.99),
        busy_imbalance=max(busy) / mean_busy if mean_busy else 1.0, utilization=mean_busy / duration_s,
        output_tok_s=totals["output"] / duration_s, duration_s=duration_s)


def build_policy(name: str, cost: CostModel, seed: int) -> RoutingPolicy:
    """A policy as the simulation runs it: prefix affinity's map bounded by what a replica's cache holds."""
    if name == PrefixAffinity.name:
        return make_policy(name, capacity_blocks=cost.prompt_cache_tokens // cost.block_tokens, seed=seed)
    return make_policy(name, seed=seed)


def run_simulation(replica_counts: Sequence[int] = (8, 64, 256), policies: Sequence[str] = tuple(POLICIES),
                   cost: CostModel = CostModel(), trace: TraceConfig = TraceConfig(),
                   seed: int = 0) -> list[RunResult]:
    """Every policy on every replica count, each replica count with its own trace (the same for every policy)."""
    results = []
    for replicas in replica_counts:
        conversations = make_trace(replicas, trace, seed=seed + replicas, block_tokens=cost.block_tokens)
        for name in policies:
            results.append(simulate(conversations, replicas, build_policy(name, cost, seed), cost))
    return results


def format_table(results: Sequence[RunResult]) -> str:
    """A Markdown table, one row per (replicas, policy)."""
    lines = ["| replicas | policy | requests | prefix hit rate | TTFT p50 ms | TTFT p99 ms | busy max/mean "
             "| utilization | output tok/s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        lines.append(f"| {result.replicas} | {result.policy} | {result.requests} | {result.hit_rate:.1%} "
                     f"| {result.ttft_p50_s * 1000:.0f} | {result.ttft_p99_s * 1000:.0f} "
                     f"| {result.busy_imbalance:.2f} | {result.utilization:.0%} | {result.output_tok_s:.0f} |")
    return "\n".join(lines)


def write_plot(results: Sequence[RunResult], path: str | Path) -> None:
    """Grouped bars per replica count: prefix hit rate, TTFT p50 and p99, busy-time imbalance, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({result.replicas for result in results})
    policies = list(dict.fromkeys(result.policy for result in results))
    by_key = {(result.replicas, result.policy): result for result in results}
    panels = [("prefix hit rate (%)", lambda r: 100 * r.hit_rate),
              ("TTFT p50 (s)", lambda r: r.ttft_p50_s),
              ("TTFT p99 (s)", lambda r: r.ttft_p99_s),
              ("busy time, busiest / mean replica", lambda r: r.busy_imbalance)]
    figure, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6))
    width = 0.8 / len(policies)
    for axis, (title, value) in zip(axes, panels):
        for offset, policy in enumerate(policies):
            xs = [index + (offset - (len(policies) - 1) / 2) * width for index in range(len(counts))]
            ys = [value(by_key[count, policy]) if (count, policy) in by_key else math.nan for count in counts]
            axis.bar(xs, ys, width, label=policy)
        axis.set_xticks(range(len(counts)), [str(count) for count in counts])
        axis.set_xlabel("replicas")
        axis.set_title(title, fontsize="medium")
    axes[0].set_ylim(0, 100)
    figure.legend(*axes[0].get_legend_handles_labels(), loc="upper center", ncol=len(policies), frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.9))
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _replica_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated replica counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"replica counts must be at least 1, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulator's options (shared by `python -m runlm.cluster.simulate` and the runlm CLI)."""
    parser.add_argument("--replicas", type=_replica_counts, default=[8, 64, 256],
                        help="comma-separated replica counts (default 8,64,256)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated routing policies (default {','.join(POLICIES)})")
    parser.add_argument("--conversations-per-replica", type=int, default=TraceConfig.conversations_per_replica)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cost", type=Path, help="JSON object overriding CostModel fields (e.g. prefill_tok_s)")
    parser.add_argument("--plot", type=Path, help="write a PNG of the results here (needs matplotlib)")
    parser.add_argument("--json", type=Path, help="write the results, cost model and trace settings here")


def run_from_args(args: argparse.Namespace) -> int:
    policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in policies if name not in POLICIES]
    if unknown or not policies:
        raise InvalidInputError(f"unknown routing policies {unknown}; choose among {', '.join(POLICIES)}")
    cost = CostModel.from_json(args.cost) if args.cost else CostModel()
    trace = TraceConfig(conversations_per_replica=args.conversations_per_replica)
    results = run_simulation(args.replicas, policies, cost, trace, seed=args.seed)
    print(format_table(results))
    if args.json:
        report = {"seed": args.seed, "cost": asdict(cost), "trace": asdict(trace),
                  "results": [dict(asdict(result), hit_rate=result.hit_rate) for result in results]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        try:
            write_plot(results, args.plot)
        except ImportError:
            raise RunlmError("--plot needs matplotlib: pip install 'runlm[cluster]'") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runlm.cluster.simulate", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except RunlmError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
