"""`runlm bench`: runlm measured beside its peers (bench.peers), the engine's batching and prompt cache
(bench.streams), speculative decoding off and on (bench.speculative), each weight type's kernel (bench.kernels),
/health under hostile requests (bench.health) and
replicas on Ray Serve (bench.replicas); bench.worker runs one peer in a process of its own, bench.common holds
what they share. Each mode is imported when asked for: none of them imports another's.
"""

from __future__ import annotations

from typing import Any

from runlm.errors import InvalidInputError


def run_bench(args: Any) -> int:
    """`runlm bench`'s modes, by its flags."""
    if args.shape:  # a random-weight model at a real shape, built once and cached
        from runlm.shapes import ensure_shape

        if args.model:
            raise InvalidInputError("give either -m/--model or --shape, not both")
        args.model = str(ensure_shape(args.shape, args.quant, threads=args.threads))
    if args.kernels:
        from runlm.bench.kernels import run_kernel_bench

        return run_kernel_bench(args)
    if args.health:
        from runlm.bench.health import run_health_bench

        return run_health_bench(args)
    if getattr(args, "replicas", None):  # through the HTTP front of N replicas on Ray Serve
        from runlm.bench.replicas import run_replica_bench  # optional: the [cluster] extra

        return run_replica_bench(args)
    if args.drafts:
        from runlm.bench.speculative import run_speculative_bench

        return run_speculative_bench(args)
    if args.streams or args.prompt_cache:
        from runlm.bench.streams import run_engine_bench

        return run_engine_bench(args)
    from runlm.bench.peers import run_peer_bench

    return run_peer_bench(args)
