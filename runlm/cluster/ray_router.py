"""Ray Serve's request router for runlm replicas: `routing.PrefixAffinity` (or another policy) behind
Ray's RequestRouter interface.

The front sends each request with its prompt's chained block hashes (the `prefix` keyword of
`ModelReplica.generate`). `choose_replicas` asks the policy for one replica and ranks it first, the
others after it (Ray takes the next rank when the first is at its `max_ongoing_requests`); the policy
learns where each request really went in `on_request_routed`, and forgets a replica that dies. Load
is the number of requests Ray last saw ongoing at each replica. Each replica's own report (its
`record_routing_stats`: queue, running, prompt-cache hit rate, tokens/s) reaches the front's
/metrics through `remote.replica_reports`.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from runlm.cluster.remote import track_router
from runlm.cluster.routing import make_policy


class RunlmRouter(RequestRouter):
    """Routes by a `runlm.cluster.routing` policy (`request_router_kwargs={"policy": name, ...}`)."""

    def initialize_state(self, policy: str = "prefix-affinity", **policy_options: Any) -> None:
        self.policy = make_policy(policy, **policy_options)
        track_router(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        load = {rid: self.replica_queue_len_cache.get(r.replica_id) or 0 for rid, r in by_id.items()}
        chosen = self.policy.choose(request_prefix(pending_request), list(by_id), load)
        if pending_request is not None:  # when every rank is full, Ray should back off rather than spin
            pending_request.routing_context.should_backoff = True
        return [[by_id[chosen]], [r for rid, r in by_id.items() if rid != chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.policy.record(request_prefix(pending_request), replica_id.unique_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)


def request_prefix(pending_request: PendingRequest | None) -> list[int]:
    """The block hashes the front attached to a request (none for calls that are not generations)."""
    if pending_request is None:
        return []
    return list(pending_request.kwargs.get("prefix") or [])
