"""`runlm serve --replicas`: bad cluster options are one-line errors before anything starts."""

from __future__ import annotations

import pytest

from runlm.cli.commands import main
from runlm.cluster.deploy import ClusterOptions, ReplicaOptions, build_app, scaling_options
from runlm.errors import RunlmError

pytest.importorskip("ray.serve")


@pytest.mark.parametrize("cluster", [ClusterOptions(replicas=0), ClusterOptions(min_replicas=3, max_replicas=2)])
def test_impossible_replica_counts_are_refused(cluster):
    with pytest.raises(RunlmError, match="replicas"):
        build_app(ReplicaOptions(model="unused.gguf"), cluster)


def test_the_front_warns_when_it_listens_beyond_loopback_without_a_key(caplog, monkeypatch):
    """As the single server does; checked before Ray starts (the replica count 0 then stops the start)."""
    from runlm.cluster.deploy import start

    monkeypatch.delenv("RUNLM_API_KEY", raising=False)
    for host, keys, warned in (("0.0.0.0", [], True), ("0.0.0.0", ["k"], False), ("127.0.0.1", [], False)):
        caplog.clear()
        with pytest.raises(RunlmError, match="replicas"):
            start(ReplicaOptions(model="unused.gguf"), ClusterOptions(replicas=0, host=host), {"api_key": keys})
        assert ("without an API key" in caplog.text) == warned, (host, keys)


def test_autoscaling_is_passed_to_ray_and_a_fixed_count_otherwise():
    assert scaling_options(ClusterOptions(replicas=3)) == {"num_replicas": 3}
    scaled = scaling_options(ClusterOptions(replicas=2, min_replicas=1, max_replicas=8, target_ongoing_requests=3))
    assert scaled == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 8, "initial_replicas": 2,
                                             "target_ongoing_requests": 3}}
    with pytest.raises(RunlmError, match="target-ongoing-requests"):
        scaling_options(ClusterOptions(min_replicas=1, max_replicas=2, target_ongoing_requests=0))


def test_the_cli_says_so_in_one_line_and_exits_non_zero(capsys):
    assert main(["serve", "--replicas", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("runlm: error:") and "--replicas" in err and "\n" not in err


def test_a_replica_is_ranked_first_by_the_policy_and_the_rest_follow():
    """The router's contract with Ray: one preferred replica, then the others (Ray takes them when it is full)."""
    import asyncio
    from types import SimpleNamespace

    from runlm.cluster.ray_router import RunlmRouter, request_prefix

    router = object.__new__(RunlmRouter)  # the policy logic only; Ray's own state is not needed for choose
    router.initialize_state = RunlmRouter.initialize_state.__get__(router)
    from runlm.cluster.routing import PrefixAffinity

    router.policy = PrefixAffinity()
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in ("a", "b", "c")]
    router.__dict__["_replica_queue_len_cache"] = SimpleNamespace(get=lambda _id: 0)
    pending = SimpleNamespace(kwargs={"prefix": [11, 12, 13]}, routing_context=SimpleNamespace(should_backoff=False))
    router.policy.record([11, 12, 13], "b")
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    assert [r.replica_id.unique_id for r in ranks[0]] == ["b"]
    assert sorted(r.replica_id.unique_id for r in ranks[1]) == ["a", "c"]
    assert pending.routing_context.should_backoff
    assert request_prefix(None) == [] and request_prefix(pending) == [11, 12, 13]
