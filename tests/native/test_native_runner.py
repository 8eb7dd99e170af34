"""runlm.native's runner: the contract the engine and the server drive, over a lean model (numpy logits, no torch).

Its logits are the lean model's (tests/lean/test_lean_engine.py: the default path's, bit for bit); here, what the
runner adds: sessions, the prompt cache's snapshots (export / restore, rings included) and the contract's checks.
"""

from __future__ import annotations

import numpy as np
import pytest

from runlm.errors import ContextOverflowError, InvalidInputError
from runlm.native.model import NativeModel
from runlm.native.runner import NativeRunner
from runlm.pytorch import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="runlm's C++ kernels are not built")


@pytest.fixture(scope="module")
def smol(smollm2_gguf):
    return NativeRunner(NativeModel.open(smollm2_gguf))


@pytest.fixture(scope="module")
def gemma(gemma3_gguf):
    return NativeRunner(NativeModel.open(gemma3_gguf))


def test_a_restored_prefix_continues_as_a_fresh_prefill(smol):
    ids = list(range(300, 340))
    full = smol.new_session(64)
    smol.extend(full, ids)
    snap = smol.export(full)
    assert snap.token_ids == ids and snap.nbytes == smol.kv_bytes(len(ids))
    for keep in (len(ids), 25):
        session = smol.new_session(64)
        assert smol.restore(session, snap, keep) and session.tokens == ids[:keep]
        fresh = smol.new_session(64)
        want = smol.extend(fresh, [*ids[:keep], 7, 8], all_positions=True)[-2:]
        np.testing.assert_array_equal(smol.extend(session, [7, 8], all_positions=True), want)
    assert not smol.restore(smol.new_session(16), snap)  # more positions than the session holds
    other = type(snap)(token_ids=snap.token_ids, cache=snap.cache, family="gemma3")
    assert not smol.restore(smol.new_session(64), other)


def test_rings_restore_whole_or_not_at_all_once_wrapped(gemma):
    window = min(w for w, ring in zip(gemma.windows, gemma.rings) if ring)
    short = list(range(20, 60))  # within the window: any prefix of it restores
    session = gemma.new_session(window + 64)
    gemma.extend(session, short)
    snap = gemma.export(session)
    restored = gemma.new_session(window + 64)
    assert gemma.restore(restored, snap, 30)
    np.testing.assert_array_equal(gemma.extend(restored, [9]), gemma.predict_logits([*short[:30], 9]))
    long = list(range(20, 20 + window + 16))  # past the window: the rings wrapped
    session = gemma.new_session(window + 64)
    gemma.extend(session, long)
    snap = gemma.export(session)
    assert not gemma.restore(gemma.new_session(window + 64), snap, len(long) - 4)
    whole = gemma.new_session(window + 64)
    assert gemma.restore(whole, snap)
    np.testing.assert_array_equal(gemma.extend(whole, [9]), gemma.predict_logits([*long, 9]))


def test_the_contracts_checks_and_defaults(smol):
    session = smol.new_session(8)
    with pytest.raises(InvalidInputError):
        smol.extend(session, [])
    with pytest.raises(InvalidInputError):
        smol.extend(session, [smol.vocab_size()])
    with pytest.raises(ContextOverflowError):
        smol.extend(session, list(range(9)))
    a, b = smol.new_session(8), smol.new_session(8)
    rows = smol.extend_batch([a, b], [[5, 6], [7]])
    np.testing.assert_array_equal(rows[0], smol.predict_logits([5, 6]))
    np.testing.assert_array_equal(rows[1], smol.predict_logits([7]))
    assert smol.decode_batch([a, b], [1, 2]).shape == (2, smol.vocab_size())
    assert smol.generate([5, 6, 7], 4) == smol.generate([5, 6, 7], 4)
    smol.reset_session(a)
    assert a.tokens == [] and a.state.tokens == []


@pytest.mark.parametrize("name", ["smol", "gemma"])
def test_a_batch_step_gives_each_session_its_own_logits(name, request):
    """Decode steps beside a prompt chunk, in one forward: each session's logits are the ones it gets alone (Gemma:
    one session past its window, its rings wrapped)."""
    runner = request.getfixturevalue(name)
    window = min([w for w, ring in zip(runner.windows, runner.rings) if ring] or [64])
    prompts = [list(range(40, 60)), list(range(70, 70 + window + 5)), list(range(90, 93))]
    steps = [[7], [8], list(range(300, 340))]  # two decode steps and a prompt chunk
    alone, together = [], []
    for prompt, step in zip(prompts, steps):
        session = runner.new_session(window + 64)
        runner.extend(session, prompt)
        alone.append(runner.extend(session, step))
    sessions = [runner.new_session(window + 64) for _ in prompts]
    for session, prompt in zip(sessions, prompts):
        runner.extend(session, prompt)
    together = runner.extend_batch(sessions, steps)
    for got, want in zip(together, alone):
        np.testing.assert_array_equal(got, want)
    assert [len(s.tokens) for s in sessions] == [len(p) + len(q) for p, q in zip(prompts, steps)]
    with pytest.raises(ContextOverflowError):  # checked before any work: no session moved
        runner.extend_batch(sessions, [[1], [2] * (window + 64), [3]])
    assert [len(s.tokens) for s in sessions] == [len(p) + len(q) for p, q in zip(prompts, steps)]


def test_hidden_states_are_the_pytorch_backends(smollm2_gguf, smol):
    """The final norm's output at every position, past one prefill chunk: what the PyTorch backend's runner gives."""
    from runlm.pytorch.loading import load

    ids = list(range(100, 100 + 300))
    want = load(smollm2_gguf).runner.hidden_states(ids)
    np.testing.assert_array_equal(smol.hidden_states(ids), want)
    with pytest.raises(InvalidInputError):
        smol.hidden_states([])


def test_a_load_writes_nothing_and_removes_older_converted_copies(smollm2_gguf, tmp_path, monkeypatch):
    """The native runtime keeps no copy of a model: a load leaves runlm's home as it was, less the converted copies
    ("lean images") that older versions left there."""
    from runlm import load

    monkeypatch.setenv("RUNLM_HOME", str(tmp_path))
    old = tmp_path / "lean" / "images" / "SmolLM2-0123abcd-0123456789ab.lean"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"RUNLM-LEAN\x00\x01" + bytes(64))
    loaded = load(smollm2_gguf)
    assert loaded.runtime == "native" and loaded.runner.predict_logits([1, 2, 3]).shape == (loaded.runner.vocab_size(),)
    assert not old.parent.exists()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["lean"]


def test_a_session_without_a_size_grows_as_it_fills(smol):
    """Sized for the whole context up front, a session's caches would be mostly untouched, yet each head's first rows
    would take a 2 MiB huge page: it starts small and doubles, with the logits of a session sized once."""
    grown = smol.new_session()
    assert grown.state.capacity < smol.max_context() == grown.state.limit
    ids = list(range(500, 500 + grown.state.capacity + 40))
    sized = smol.new_session(len(ids) + 1)
    np.testing.assert_array_equal(smol.extend(grown, ids), smol.extend(sized, ids))
    assert grown.state.capacity >= len(ids) and grown.tokens == sized.tokens
    np.testing.assert_array_equal(smol.extend(grown, [7]), smol.extend(sized, [7]))
    restored = smol.new_session()
    assert smol.restore(restored, smol.export(grown)) and restored.state.capacity >= len(ids) + 1
    np.testing.assert_array_equal(smol.extend(restored, [9]), smol.extend(grown, [9]))


def test_batched_steps_read_the_caches_a_session_grew_into(smol):
    """A session keeps its caches' addresses for the C call between steps; decode steps that take it past its
    capacity (the caches replaced by bigger ones) read and write the new caches: the logits of a session sized once."""
    grown, sized = smol.new_session(), smol.new_session(smol.max_context())
    start = grown.state.capacity - 3
    prompt = list(range(300, 300 + start))
    np.testing.assert_array_equal(smol.extend(grown, prompt), smol.extend(sized, prompt))
    other = smol.new_session()
    smol.extend(other, [5, 6, 7])
    for step in range(8):  # across the capacity: the caches are replaced within these steps
        token = 40 + step
        got = smol.extend_batch([other, grown], [[token], [token]])
        np.testing.assert_array_equal(got[1], smol.extend(sized, [token]))
    assert grown.state.capacity > start + 3


def test_a_broken_library_under_runlms_home_is_built_again(tmp_path):
    """A kernels library runlm built at first use and later finds cut short (or of another source) is built again,
    not loaded into a crash. Run where the install built none; the build is the installed library's copy (the same
    source and flags), so the test checks the recovery without compiling."""
    import os
    import subprocess
    import sys

    code = """
import importlib.util, os, shutil
from runlm.native import library
from runlm.native import build
installed = importlib.util.find_spec(f"runlm.native._kernels_{build.variant()}").origin
path = library._library_path()
path.parent.mkdir(parents=True)
path.write_bytes(open(installed, "rb").read()[:4096])  # a build cut short
built = []
library.installed_library = lambda: None
def fake_compile(target):  # as _compile does: a new file put in place whole (a loaded library is never written over)
    built.append(target)
    shutil.copy(installed, target.with_suffix(".new"))
    os.replace(target.with_suffix(".new"), target)
library._compile = fake_compile
assert library.library().rl_isa() and built == [path], built
print("rebuilt")
"""
    from runlm.native import library

    if library.installed_library() is None:  # a checkout whose csrc changed since it was installed
        pytest.skip("the installed kernels are of an older source: their copy is no build of this one")
    env = {**os.environ, "RUNLM_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "rebuilt" in result.stdout, result.stderr[-2000:]
