"""Models by name from the Hugging Face Hub (runlm.hub), with the real `huggingface_hub` client against a loopback
server speaking the Hub's HTTP API (HF_ENDPOINT): pick, download, resume, verify, list, remove, progress reports, and
one-line typed errors for a wrong hash, a missing repo, a gated repo, a missing quantization and a hub that cannot be
reached."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys

import pytest
from hub_harness import TOKEN, FakeHub

from runlm import hub
from runlm.errors import CatalogError, DownloadError, ModelAccessError, ModelNotFoundError

REPO, GATED = "loopback/SmolLM2-135M-Instruct-GGUF", "loopback/gated-GGUF"


@pytest.fixture(scope="module")
def fake_hub(smollm2_gguf, tmp_path_factory):
    readme = tmp_path_factory.mktemp("repo") / "README.md"
    readme.write_text("# SmolLM2 135M Instruct, GGUF\n")
    files = {"SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_gguf, "README.md": readme}
    server = FakeHub({REPO: files, GATED: {"model-Q4_1.gguf": smollm2_gguf}}, gated={GATED})
    yield server
    server.close()


@pytest.fixture
def env(fake_hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    monkeypatch.setenv("RUNLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token of the machine's own
    return dict(os.environ)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def runlm(env, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "runlm", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_pull_list_generate_and_remove_from_the_command_line(env, smollm2_gguf):
    ref = f"hf.co/{REPO}:Q4_1"
    pulled = runlm(env, "pull", ref)
    assert pulled.returncode == 0, pulled.stderr[-2000:]
    path = pulled.stdout.strip().splitlines()[-1]
    assert sha256(type(smollm2_gguf)(path)) == sha256(smollm2_gguf)
    listed = runlm(env, "list")
    assert f"hf.co/{REPO}:SmolLM2-135M-Instruct.Q4_1.gguf  98.4 MB" in listed.stdout
    answer = runlm(env, "generate", "-m", ref, "--raw", "--max-tokens", "4", "Once upon a time")
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr[-2000:]
    removed = runlm(env, "rm", f"hf.co/{REPO}")
    assert removed.returncode == 0 and "removed" in removed.stdout
    assert "hf.co/" not in runlm(env, "list").stdout


def test_the_default_quantization_and_a_file_by_name(env):
    model, projector = hub.pull(hub.parse_ref(f"hf.co/{REPO}"), progress=False)
    assert model.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and projector is None
    by_name, _ = hub.pull(hub.parse_ref(f"hf.co/{REPO}:SmolLM2-135M-Instruct.Q4_1.gguf"), progress=False)
    assert by_name == model


def test_an_interrupted_download_resumes(env, fake_hub, smollm2_gguf):
    """The first download stops after 20 MB; the next request asks for the rest only (a Range from where the
    partial file ends), and the file is whole and verified."""
    fake_hub.ranges.clear()
    fake_hub.cut_after["SmolLM2-135M-Instruct.Q4_1.gguf"] = 20 << 20
    ref = hub.parse_ref(f"hf.co/{REPO}:Q4_1")
    try:
        model, _ = hub.pull(ref, progress=False)
    except CatalogError:  # a client that does not retry within the call resumes on the next pull
        model, _ = hub.pull(ref, progress=False)
    assert sha256(model) == sha256(smollm2_gguf)
    assert any(start >= 20 << 20 for start in fake_hub.ranges.get("SmolLM2-135M-Instruct.Q4_1.gguf", [])), \
        fake_hub.ranges


def test_a_file_that_does_not_match_its_hash_is_removed_and_refused(env, fake_hub):
    fake_hub.corrupt.add("SmolLM2-135M-Instruct.Q4_1.gguf")
    try:
        result = runlm(env, "pull", f"hf.co/{REPO}:Q4_1")
    finally:
        fake_hub.corrupt.clear()
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert "does not match the sha256 the Hub lists" in lines[-1] and "Traceback" not in result.stderr
    assert not [p for p in (env_home(env) / "hub").rglob("*.gguf") if p.exists()]


def env_home(env):
    from pathlib import Path

    return Path(env["RUNLM_HOME"])


@pytest.mark.parametrize("ref, message", [
    ("hf.co/loopback/no-such-repo", "no such repo on the Hub"),
    (f"hf.co/{GATED}", "the repo is gated: accept its terms on the Hub and set HF_TOKEN"),
    (f"hf.co/{REPO}:Q8_0", "no GGUF with 'Q8_0' in its name (the repo has: Q4_1)"),
    ("hf.co/not-a-repo", "expected hf.co/<user>/<repo>[:<quantization>]"),
])
def test_each_failure_is_one_line_and_a_nonzero_exit(env, ref, message):
    result = runlm(env, "pull", ref)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert message in result.stderr.strip().splitlines()[-1], result.stderr[-1000:]


def test_a_hub_that_cannot_be_reached_is_a_download_error(env, monkeypatch):
    """A port bound but not listening refuses at once: the HTTP client's own error becomes runlm's, one line."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
        with pytest.raises(DownloadError, match=f"hf.co/{REPO}: download failed: .*refused"):
            hub.pull(hub.parse_ref(f"hf.co/{REPO}"), progress=False)


def test_progress_is_told_per_file_and_the_types_of_failures(env, smollm2_gguf):
    reports: list[hub.FileProgress] = []
    hub.pull(hub.parse_ref(f"hf.co/{REPO}:Q4_1"), on_progress=reports.append)
    size, digest = smollm2_gguf.stat().st_size, sha256(smollm2_gguf)
    assert {(r.name, r.sha256, r.total) for r in reports} == {("SmolLM2-135M-Instruct.Q4_1.gguf", digest, size)}
    completed = [r.completed for r in reports]
    assert completed[0] == 0 and completed[-1] == size and completed == sorted(completed)
    assert reports[-1].verifying and not any(r.verifying for r in reports[:-1])
    with pytest.raises(ModelNotFoundError):
        hub.files_to_pull(hub.parse_ref("hf.co/loopback/no-such-repo"))
    with pytest.raises(ModelNotFoundError):
        hub.files_to_pull(hub.parse_ref(f"hf.co/{REPO}:Q8_0"))
    with pytest.raises(ModelAccessError):
        hub.files_to_pull(hub.parse_ref(f"hf.co/{GATED}"))


def test_a_gated_repo_downloads_with_hf_token(env, monkeypatch, smollm2_gguf):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    model, _ = hub.pull(hub.parse_ref(f"hf.co/{GATED}"), progress=False)
    assert sha256(model) == sha256(smollm2_gguf)


def test_choosing_among_a_repos_files():
    ref = hub.parse_ref("hf.co/u/r")
    assert hub.parse_ref("hf.co/u/r:latest") == ref  # Ollama's default tag: the default quantization
    files = ["model-Q4_K_M.gguf", "model-Q4_K_S.gguf", "model-Q8_0.gguf", "mmproj-model-f16.gguf",
             "mmproj-model-Q8_0.gguf", "README.md"]
    assert hub.choose_files(ref, files) == (["model-Q4_K_M.gguf"], "mmproj-model-f16.gguf")
    assert hub.choose_files(hub.parse_ref("hf.co/u/r:q8_0"), files)[0] == ["model-Q8_0.gguf"]
    assert hub.choose_files(hub.parse_ref("hf.co/u/r:Q4_K"), ["m-Q4_K.gguf", "m-Q4_K_M.gguf"])[0] == ["m-Q4_K.gguf"]
    parts = ["m-Q4_K_M-00002-of-00002.gguf", "m-Q4_K_M-00001-of-00002.gguf", "m-Q8_0.gguf"]
    assert hub.choose_files(hub.parse_ref("hf.co/u/r:Q4_K_M"), parts)[0] == sorted(parts[:2])
    with pytest.raises(CatalogError, match="1 of the 2 parts"):
        hub.choose_files(hub.parse_ref("hf.co/u/r:Q4_K_M"), parts[:1])
    with pytest.raises(CatalogError, match="no GGUF model file"):
        hub.choose_files(ref, ["README.md", "mmproj-f16.gguf"])
