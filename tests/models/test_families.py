"""Every family against transformers on tiny random models, and the runner contract on each.

Tolerance: f32 logits max abs diff <= 1e-4 against transformers, from safetensors and from GGUF.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from reference.tiny import GEMMA_WINDOW, build_gemma3, build_llama, build_qwen3

from runlm.errors import InvalidInputError
from runlm.pytorch.loading import load
from runlm.runner import LmRunner

BUILDERS = {"llama32": build_llama, "qwen3": build_qwen3, "gemma": build_gemma3}
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    reference = BUILDERS[family](directory)
    return family, reference, directory


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_prefill_logits_match_transformers(tiny, fmt):
    family, reference, directory = tiny
    loaded = load(directory / fmt)
    assert loaded.runner.family() == family
    ids = prompt_ids(2 * GEMMA_WINDOW + 5)  # longer than the tiny Gemma's sliding window
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    runner = loaded.runner
    got_all = runner.extend(runner.new_session(), ids, all_positions=True)
    assert np.abs(got_all - want.numpy()).max() <= TOL
    assert np.abs(runner.predict_logits(ids) - want[-1].numpy()).max() <= TOL


@pytest.mark.parametrize("fmt", ["hf", "model.gguf"])
def test_decode_matches_transformers_across_window(tiny, fmt):
    family, reference, directory = tiny
    runner = load(directory / fmt).runner
    ids = prompt_ids(4, seed=1)
    logits = runner.prefill_logits(ids)
    context = list(ids)
    for step in range(3 * GEMMA_WINDOW):
        with torch.no_grad():
            want = reference(torch.tensor([context])).logits[0, -1]
        assert np.abs(logits - want.numpy()).max() <= TOL, f"step {step}"
        token = int(torch.argmax(want)) if step % 2 else (step * 37) % 384
        context.append(token)
        logits = runner.decode_logits(token)


def test_generate_equals_transformers_greedy(tiny):
    family, reference, directory = tiny
    runner = load(directory / "hf").runner
    ids = prompt_ids(5, seed=2)
    got = runner.generate(ids, 20)
    want = reference.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert got == want[0, len(ids) :].tolist()


def test_cached_generate_equals_reprefill_default(tiny):
    _, _, directory = tiny
    runner = load(directory / "model.gguf").runner
    ids = prompt_ids(7, seed=3)
    cached = runner.generate(ids, 15)
    reprefill = LmRunner.generate(runner, ids, 15)  # the contract's default: full prefill each step
    assert cached == reprefill


def test_on_token_false_stops(tiny):
    _, _, directory = tiny
    runner = load(directory / "hf").runner
    seen: list[int] = []
    out = runner.generate(prompt_ids(3), 10, lambda t: seen.append(t) or len(seen) < 4)
    assert out == seen and len(out) == 4


def test_export_restore_decode_equals_uninterrupted(tiny):
    _, _, directory = tiny
    runner = load(directory / "model.gguf").runner
    ids = prompt_ids(2 * GEMMA_WINDOW, seed=4)
    runner.prefill_logits(ids)
    snap = runner.export_session()
    assert snap is not None and snap.token_ids == ids and snap.nbytes > 0
    uninterrupted = [runner.decode_logits(t) for t in (5, 6, 7, 8, 9, 10, 11, 12)]
    runner.prefill_logits(prompt_ids(9, seed=5))  # unrelated work in between
    assert runner.restore_session(snap)
    resumed = [runner.decode_logits(t) for t in (5, 6, 7, 8, 9, 10, 11, 12)]
    for a, b in zip(uninterrupted, resumed):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("reuse_kind", ["zero", "one", "half", "len-1", "full"])
def test_prefill_reusing_equals_full_prefill(tiny, reuse_kind):
    _, _, directory = tiny
    runner = load(directory / "model.gguf").runner
    prompt = prompt_ids(3 * GEMMA_WINDOW, seed=6)
    # The snapshot covers a prefix of the prompt plus a divergent tail.
    shared = {"zero": 0, "one": 1, "half": len(prompt) // 2, "len-1": len(prompt) - 1, "full": len(prompt)}[reuse_kind]
    runner.prefill_logits(prompt[:shared] + [1, 2, 3] if shared < len(prompt) else prompt)
    snap = runner.export_session()
    want = load(directory / "model.gguf").runner.prefill_logits(prompt)
    got = runner.prefill_logits_reusing(prompt, snap, shared)
    assert np.abs(got - want).max() <= 1e-5
    # And decoding continues exactly as after a full prefill.
    assert runner.own_session.tokens == prompt


def test_reusing_rejects_mismatched_prefix(tiny):
    _, _, directory = tiny
    runner = load(directory / "hf").runner
    runner.prefill_logits([5, 6, 7, 8])
    snap = runner.export_session()
    with pytest.raises(InvalidInputError):
        runner.prefill_logits_reusing([5, 9, 7, 8, 1], snap, 3)
    with pytest.raises(InvalidInputError):
        runner.prefill_logits_reusing([5, 6, 7, 8, 1], snap, 5)


def test_restore_refuses_other_family(tiny):
    family, _, directory = tiny
    runner = load(directory / "hf").runner
    runner.prefill_logits([5, 6, 7])
    snap = runner.export_session()
    snap.family = "other"
    assert runner.restore_session(snap) is False


def test_decode_batch_equals_each_sequence_alone(tiny):
    _, _, directory = tiny
    runner = load(directory / "model.gguf").runner
    prompts = [prompt_ids(n, seed=10 + n) for n in (3, 2 * GEMMA_WINDOW, 9)]  # different positions
    sessions, alone = [], []
    for prompt in prompts:
        session = runner.new_session()
        runner.prefill(session, prompt)
        sessions.append(session)
        reference = load(directory / "model.gguf").runner
        reference.prefill_logits(prompt)
        alone.append(reference)
    for step in range(GEMMA_WINDOW + 2):  # the long prompt's sliding layers wrap around meanwhile
        tokens = [(step * 31 + i * 7) % 384 for i in range(len(prompts))]
        batched = runner.decode_batch(sessions, tokens)
        for i, reference in enumerate(alone):
            single = reference.decode_logits(tokens[i])
            assert np.abs(batched[i] - single).max() <= TOL, (step, i)  # batched matmul order differs
    assert [s.tokens for s in sessions] == [r.own_session.tokens for r in alone]
