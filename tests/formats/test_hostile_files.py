"""Hostile model files: every malformed GGUF or Hugging Face directory is refused with a RunlmError that names
what is wrong, never a crash, a hang, a giant allocation or a foreign exception.

Each variant (tests/formats/hostile.py: targeted hyperparameter, header, shape, tokenizer and config.json
cases, seeded truncations and header byte flips of the real SmolLM2 GGUF and of tiny models, broken projectors
beside a valid model) is loaded and run for a token in a worker subprocess under a memory cap, with a time
limit per variant; the workers batch many variants each, two at a time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hostile import LOADS, catalog, targeted
from reference.tiny import build_gemma3, build_llama, build_qwen3
from reference.tiny_vision import build_gemma3_vision

from runlm.pytorch import kernels

SEED = 14
WORKERS = 2
TIME_LIMIT_S = 30  # per variant; a load takes well under a second
MEMORY_CAP_BYTES = 6 << 30  # address space: torch plus a loaded SmolLM2 use under 2 GiB
WORKER = Path(__file__).with_name("hostile.py")
PLACEHOLDER_BASES = {name: f"/{name}" for name in ("smollm2", "llama", "qwen3", "gemma3", "vision")}
TARGETED = [variant.name for variant in targeted(PLACEHOLDER_BASES)]


@pytest.fixture(scope="module")
def bases(tmp_path_factory, smollm2_gguf) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hostile_bases")
    for name, build in (("llama", build_llama), ("qwen3", build_qwen3), ("gemma3", build_gemma3),
                        ("vision", build_gemma3_vision)):
        build(root / name)
    return {"smollm2": str(smollm2_gguf), **{name: str(root / name) for name in ("llama", "qwen3", "gemma3",
                                                                                  "vision")}}


def _worker_env(workdir: Path) -> dict[str, str]:
    return {**os.environ, "RUNLM_HOME": str(workdir / "home"), "OMP_NUM_THREADS": "1"}


def _run_worker(indices: list[int], bases: dict[str, str], workdir: Path) -> dict[int, dict]:
    """Run `indices` in worker processes until each has an outcome; a process that dies inside a variant gives
    that variant its cause of death (a signal: crash; the time limit: hang) and a fresh worker takes the rest."""
    outcomes: dict[int, dict] = {}
    env = _worker_env(workdir)
    pending = list(indices)
    while pending:
        spec = workdir / f"spec-{pending[0]}.json"
        spec.write_text(json.dumps({"bases": bases, "seed": SEED, "indices": pending, "workdir": str(workdir),
                                    "time_limit_s": TIME_LIMIT_S, "memory_cap_bytes": MEMORY_CAP_BYTES}))
        proc = subprocess.run([sys.executable, str(WORKER), str(spec)], capture_output=True, text=True, env=env,
                              timeout=TIME_LIMIT_S * len(pending) + 120)
        running = None
        for line in proc.stdout.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "start":
                running = int(rest)
            elif kind == "done":
                index, _, payload = rest.partition(" ")
                outcomes[int(index)] = json.loads(payload)
                running = None
        if running is not None:
            if proc.returncode < 0:
                status = f"crash ({signal.Signals(-proc.returncode).name})"
            elif "Timeout (" in proc.stderr:
                status = f"hang (over {TIME_LIMIT_S} s)"
            else:
                status = f"died (exit {proc.returncode})"
            outcomes[running] = {"status": status, "message": proc.stderr[-2000:]}
        elif proc.returncode != 0 or not outcomes.keys() & set(pending):
            raise AssertionError(f"the hostile-file worker failed outside any variant:\n{proc.stderr[-4000:]}")
        pending = [i for i in pending if i not in outcomes]
    return outcomes


@pytest.fixture(scope="module")
def outcomes(bases, tmp_path_factory) -> dict[str, dict]:
    """Every variant's outcome by name: status ok / refused (a RunlmError) / foreign / crash / hang / died."""
    assert kernels.available() or kernels.unavailable_reason()  # build the kernels here, not in a timed variant
    variants = catalog(bases, SEED)
    workdir = tmp_path_factory.mktemp("hostile_work")
    # The native kernels too: where the install holds none of this source (a checkout whose csrc changed since it
    # was installed), the first load would compile them, a minute inside a variant's time limit.
    subprocess.run([sys.executable, "-c", "from runlm.native.library import library; library()"],
                   env=_worker_env(workdir), check=True, timeout=900)
    shards = [list(range(len(variants)))[k::WORKERS] for k in range(WORKERS)]
    results: dict[int, dict] = {}
    with ThreadPoolExecutor(WORKERS) as pool:
        for part in pool.map(lambda shard: _run_worker(shard, bases, workdir), shards):
            results.update(part)
    by_name = {}
    for index, variant in enumerate(variants):
        by_name[variant.name if variant.name not in by_name else f"{variant.name} #{index}"] = {
            **results[index], "must_load": variant.must_load}
    return by_name


def test_no_crash_hang_or_foreign_exception(outcomes):
    """The fuzz verdict over a few hundred variants: each loads and runs, or raises a RunlmError."""
    bad = {name: o for name, o in outcomes.items() if o["status"] not in ("ok", "refused")}
    assert not bad, "\n".join(f"{name}: {o['status']} {o.get('type', '')} {o.get('message', '')}\n{o.get('where', '')}"
                              for name, o in bad.items())
    refused = sum(o["status"] == "refused" for o in outcomes.values())
    assert len(outcomes) >= 300 and refused >= 150, (len(outcomes), refused)  # the variants really are hostile


def test_broken_projector_beside_a_model_is_skipped_with_a_warning(outcomes):
    beside = {name: o for name, o in outcomes.items() if o["must_load"]}
    assert len(beside) >= 10
    for name, outcome in beside.items():
        assert outcome["status"] == "ok", (name, outcome)
        assert any("skipping the vision projector mmproj-broken.gguf" in w for w in outcome["warnings"]), name


@pytest.mark.parametrize("name", TARGETED)
def test_targeted_case(outcomes, bases, name):
    """Each case the issue measured: refused with a message naming the key or tensor, or (LOADS) loaded fine."""
    expect = next(v.expect for v in targeted(bases) if v.name == name)
    outcome = outcomes[name]
    if expect == LOADS:
        assert outcome["status"] == "ok", outcome
        return
    assert outcome["status"] == "refused", outcome
    assert re.search(expect, outcome["message"]), (expect, outcome["message"])
