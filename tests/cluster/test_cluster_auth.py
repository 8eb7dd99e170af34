"""Joining a Ray cluster: `--ray-address` refuses one whose GCS answers without Ray's token auth (anyone who
reaches its ports could run code on it), unless `--insecure-ray` is given."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from ray._private.services import canonicalize_bootstrap_address  # noqa: E402
from server_harness import free_port  # noqa: E402

from runlm.cluster.deploy import ClusterUnavailableError, answers_without_token, checked_cluster  # noqa: E402


@pytest.fixture(scope="module")
def open_ray():
    """A Ray head started without token auth, as `ray start --head` starts one for a cluster (on this node's IP), in
    its own process group (`ray stop` would stop every Ray on the machine)."""
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}", "--num-cpus=1",
         "--include-dashboard=false", "--block"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    address = canonicalize_bootstrap_address(f"127.0.0.1:{port}")  # Ray's own: this node's IP
    deadline = time.monotonic() + 120
    while True:
        try:
            answers_without_token(address, timeout_s=2.0)
            break
        except ClusterUnavailableError:
            if head.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the Ray head did not start")
            time.sleep(0.5)
    yield address
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(5)  # a head that has served no job: what it would tidy in its 30 s of shutdown is its own
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(30)


def test_a_gcs_without_token_auth_answers_a_call_without_a_token(open_ray):
    assert answers_without_token(open_ray) is True


def test_the_check_passes_with_insecure_and_refuses_unreachable_clusters_at_once(open_ray):
    assert checked_cluster(open_ray, insecure=True) == open_ray
    with pytest.raises(ClusterUnavailableError, match="answers without a token"):
        checked_cluster(open_ray)
    started = time.monotonic()
    with pytest.raises(ClusterUnavailableError, match="did not answer"):
        checked_cluster(f"127.0.0.1:{free_port()}", insecure=True)
    assert time.monotonic() - started < 30


def test_serve_refuses_to_join_a_cluster_without_token_auth_in_one_line(open_ray, smollm2_gguf):
    result = subprocess.run(
        [sys.executable, "-m", "runlm", "serve", "-m", str(smollm2_gguf), "--replicas", "1", "--ray-address",
         open_ray, "--port", str(free_port())],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("runlm:")]
    assert len(errors) == 1 and "answers without a token" in errors[0] and "--insecure-ray" in errors[0], \
        result.stderr
    assert "Traceback" not in result.stderr
