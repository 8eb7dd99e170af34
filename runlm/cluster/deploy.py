"""runlm on Ray Serve: N model replicas behind one front that serves the single server's routes.

- `RunlmReplica` (N of them, or autoscaled) is the one Serve deployment: a `ModelReplica` each, with its own
  threads; its calls are routed by `RunlmRouter` (prefix affinity by default).
- The front runs in the process that started the replicas (`runlm serve --replicas`): `create_app` over a
  `RemoteScheduler` that calls the deployment's handle, on the single server's own uvicorn setup, so the routes,
  the chat page, /metrics, the key checks, the body limit, the header deadline and the header size cap are the
  single server's. Serve's HTTP proxy is not started. The front loads the model too: the tokenizer and chat
  template plan requests here, and embeddings run here.

Ray runs the replicas' processes, restarts a replica that dies, drains replicas on shutdown and autoscales;
`runlm serve --replicas N` starts a local Ray, or joins one with `--ray-address`: a cluster that answers without
Ray's token auth is refused unless `--insecure-ray` is given.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from runlm.cluster.replica import ModelReplica, ReplicaOptions
from runlm.errors import RunlmError

log = logging.getLogger("runlm.cluster")

APP_NAME = "runlm"
NO_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray takes loopback as this node's IP


class ClusterUnavailableError(RunlmError):
    """Ray Serve is not installed, or the Ray cluster cannot be reached."""


@dataclass
class ClusterOptions:
    """How many replicas, how they are routed and scaled, and where Ray and HTTP are."""

    replicas: int = 2
    threads_per_replica: int = 1
    ray_address: str | None = None  # None: start a local Ray; "auto" or "ray://host:port": join one
    policy: str = "prefix-affinity"  # runlm.cluster.routing: prefix-affinity | power-of-two | round-robin
    min_replicas: int | None = None  # with max_replicas: autoscale between them
    max_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    host: str = "127.0.0.1"
    port: int = 8000
    stats_period_s: float = 1.0  # how often replicas report to the router (routing stats)
    graceful_shutdown_s: float = 20.0  # how long a stopping replica may finish what it runs
    insecure_ray: bool = False  # join a Ray cluster that answers without Ray's token auth
    header_timeout_s: float | None = None  # the front's header deadline (None: the single server's default)


def _serve():
    try:
        from ray import serve
    except ImportError as exc:
        raise ClusterUnavailableError(
            "replicas need Ray Serve: pip install 'runlm[cluster]' (or pip install 'ray[serve]')") from exc
    return serve


def _serve_grpc_on_loopback() -> None:
    """Serve opens a gRPC server in each replica for calls between deployments, on every interface ("[::]:0",
    fixed in Ray Serve); on a node whose IP is loopback (init_ray's local Ray) it listens on loopback instead.
    Runs in the replica's process, before Serve starts that server."""
    import ray
    from ray.serve._private import replica

    original = getattr(replica, "add_port_to_grpc_server", None)
    if original is None or getattr(original, "runlm_loopback", False):
        return
    if ray.util.get_node_ip_address() not in ("127.0.0.1", "::1"):
        return

    def on_loopback(server: Any, address: str) -> int:
        return original(server, address.replace("[::]:", "127.0.0.1:"))

    on_loopback.runlm_loopback = True  # type: ignore[attr-defined]
    replica.add_port_to_grpc_server = on_loopback


class RunlmReplica(ModelReplica):
    """The replica as a Serve deployment: named by Serve, reporting its stats to the router."""

    def __init__(self, options: ReplicaOptions):
        _serve_grpc_on_loopback()
        replica_id = _serve().get_replica_context().replica_id.unique_id
        super().__init__(options, replica_id=replica_id)

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats()

    def __del__(self) -> None:  # Serve calls it when the replica stops, after draining
        self.close()


class Front:
    """The HTTP front in this process: the single server's app over the replicas' handle, on uvicorn in a thread."""

    def __init__(self, replicas: Any, options: ReplicaOptions, cluster: ClusterOptions,
                 server_options: dict[str, Any]):
        import uvicorn

        from runlm.cluster.remote import RemoteScheduler, replica_reports
        from runlm.engine import Engine
        from runlm.runtime import load
        from runlm.server.app import create_app
        from runlm.server.timeouts import uvicorn_options

        # the front plans and tokenizes; the replicas own the cores
        loaded = load(options.model, dtype=options.dtype, max_context=options.ctx, mmproj=options.mmproj,
                      swa_full=options.swa_full, threads=1, runtime=options.runtime)
        engine = Engine(loaded.runner, loaded.tokenizer, context_length=loaded.context_length, prompt_cache_mb=0)
        scheduler = RemoteScheduler(engine, replicas, max_batch=options.max_batch, max_queue=options.max_queue,
                                    stats=replica_reports)
        app = create_app(loaded, scheduler=scheduler, prompt_cache_mb=options.prompt_cache_mb,
                         max_queue=options.max_queue, max_batch=options.max_batch, **server_options)
        transport = uvicorn_options() if cluster.header_timeout_s is None else uvicorn_options(cluster.header_timeout_s)
        config = uvicorn.Config(app, host=cluster.host, port=cluster.port, log_level="warning", **transport)
        self.server = uvicorn.Server(config)
        self.url = f"http://{cluster.host}:{cluster.port}"
        self._thread = threading.Thread(target=self.server.run, name="runlm-front", daemon=True)

    def listen(self, timeout_s: float = 60.0) -> None:
        """Serve, and return once the socket listens (or raise with why it could not)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive():
                raise ClusterUnavailableError(f"the front could not listen on {self.url} (is the port taken?)")
            if time.monotonic() > deadline:
                raise ClusterUnavailableError(f"the front did not start listening on {self.url} in {timeout_s} s")
            time.sleep(0.05)

    def close(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)


def scaling_options(cluster: ClusterOptions) -> dict[str, Any]:
    """The replica deployment's size: a fixed count, or Ray's autoscaler between min and max replicas."""
    if cluster.min_replicas is None and cluster.max_replicas is None:
        if cluster.replicas < 1:
            raise RunlmError(f"--replicas must be at least 1, got {cluster.replicas}")
        return {"num_replicas": cluster.replicas}
    low = cluster.min_replicas if cluster.min_replicas is not None else 1
    high = cluster.max_replicas if cluster.max_replicas is not None else max(low, cluster.replicas)
    if not 0 <= low <= high or high < 1:
        raise RunlmError(f"autoscaling needs 0 <= --min-replicas <= --max-replicas (>= 1), got {low}..{high}")
    if cluster.target_ongoing_requests <= 0:
        raise RunlmError(f"--target-ongoing-requests must be positive, got {cluster.target_ongoing_requests}")
    return {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                   "initial_replicas": min(max(cluster.replicas, low), high),
                                   "target_ongoing_requests": cluster.target_ongoing_requests}}


def build_app(options: ReplicaOptions, cluster: ClusterOptions):
    """The Serve application (the replicas), ready for `serve.run`."""
    serve = _serve()
    from ray.serve.config import RequestRouterConfig

    options = replace(options, threads=cluster.threads_per_replica)  # the caller's options stay as given
    scaling = scaling_options(cluster)
    replica = serve.deployment(
        RunlmReplica,
        name="RunlmReplica",
        ray_actor_options={"num_cpus": cluster.threads_per_replica},
        max_ongoing_requests=options.max_batch + options.max_queue,
        graceful_shutdown_timeout_s=cluster.graceful_shutdown_s,
        request_router_config=RequestRouterConfig(
            request_router_class="runlm.cluster.ray_router:RunlmRouter",
            request_router_kwargs={"policy": cluster.policy},
            request_routing_stats_period_s=cluster.stats_period_s),
        **scaling,
    )
    return replica.bind(options)


def init_ray(address: str | None = None, *, log_to_driver: bool = True, insecure: bool = False,
             **options: Any) -> None:
    """Start a local Ray that listens on loopback only (with Ray's token auth, on by default), or join the Ray at
    `address`, which must answer and require a token (`checked_cluster`) unless `insecure`.

    Ray binds its servers (the GCS, the raylets, every worker, the dashboard and runtime-env agents) to the node's
    IP on every interface, unless that IP is loopback, which it takes only where told that this node makes no
    cluster: so a local Ray is told that, before Ray reads it (and where Ray was imported already, the
    constant it read is set too)."""
    _serve()  # installed, or one line saying what to install
    if address is None:
        os.environ[NO_CLUSTER_ENV] = "0"
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    else:
        address = checked_cluster(address, insecure)
    import ray

    try:
        # "local": a new Ray of this process's own, never one found running on the machine
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=log_to_driver,
                 ignore_reinit_error=True, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterUnavailableError(f"cannot start or join Ray at {address!r}: {exc}") from exc


def checked_cluster(address: str, insecure: bool = False) -> str:
    """The GCS address ("host:port") of the Ray cluster at `address` ("auto" included), once its GCS has answered,
    before joining it (Ray itself retries an unreachable one for minutes). A cluster whose GCS answers a call that
    carries no token is refused unless `insecure`: with Ray's token auth off, anyone who reaches its ports runs
    code on it, and runlm's API keys protect none of them."""
    if address.startswith("ray://"):
        if insecure:
            return address
        raise ClusterUnavailableError(f"{address}: a Ray Client address cannot be checked for Ray's token auth; "
                                      "join with the GCS address (host:6379), or pass --insecure-ray")
    from ray._private.services import canonicalize_bootstrap_address

    try:
        gcs = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError) as exc:
        raise ClusterUnavailableError(f"no Ray cluster at {address!r}: {exc}") from exc
    if gcs is None:
        raise ClusterUnavailableError(f"no Ray cluster at {address!r}: none is running on this machine")
    if answers_without_token(gcs) and not insecure:
        raise ClusterUnavailableError(
            f"the Ray cluster at {gcs} answers without a token (Ray's token auth is off): start it with "
            "RAY_AUTH_MODE=token (see docs/cluster.md), or pass --insecure-ray")
    return gcs


def answers_without_token(gcs_address: str, timeout_s: float = 10.0) -> bool:
    """Whether the GCS at `gcs_address` ("host:port") answers a call that carries no token."""
    import grpc
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(gcs_address) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                return False
            raise ClusterUnavailableError(f"the Ray GCS at {gcs_address} did not answer: {exc.details()}") from exc
    return True


_FRONT: Front | None = None  # the front this process serves, between start() and stop()


def start(options: ReplicaOptions, cluster: ClusterOptions, server_options: dict[str, Any] | None = None,
          *, log_to_driver: bool = True) -> str:
    """Start (or join) Ray, deploy the replicas, serve the front here and return its base URL once it listens."""
    global _FRONT
    serve = _serve()
    import ray

    from runlm.server.app import warn_if_open

    warn_if_open(cluster.host, (server_options or {}).get("api_key"))
    app = build_app(options, cluster)  # bad options fail here, before Ray starts
    if not ray.is_initialized():
        init_ray(cluster.ray_address, log_to_driver=log_to_driver, insecure=cluster.insecure_ray)
    serve.start(proxy_location="Disabled")
    t0 = time.monotonic()
    replicas = serve.run(app, name=APP_NAME, route_prefix=None, blocking=False)
    front = Front(replicas, options, cluster, dict(server_options or {}))
    front.listen()
    _FRONT = front
    log.info("runlm: %s replicas of %s ready in %.1f s (%s routing)", cluster.replicas, options.model,
             time.monotonic() - t0, cluster.policy)
    return front.url


def stop() -> None:
    """Stop the front, drain and delete the replicas, then leave Ray (a Ray this process started stops with it)."""
    global _FRONT
    serve = _serve()
    import ray

    try:
        if _FRONT is not None:
            _FRONT.close()
            _FRONT = None
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_replicas(options: ReplicaOptions, cluster: ClusterOptions, server_options: dict[str, Any]) -> None:
    """`runlm serve --replicas N`: run until interrupted."""
    url = start(options, cluster, server_options)
    print(f"runlm: serving {options.model} on {url} with {cluster.replicas} replicas "
          f"({cluster.threads_per_replica} threads each, {cluster.policy} routing); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        stop()


__all__ = ["ClusterOptions", "ClusterUnavailableError", "Front", "ReplicaOptions", "answers_without_token", "build_app",
           "init_ray", "checked_cluster", "serve_replicas", "start", "stop"]
