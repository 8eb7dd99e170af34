"""Each sampler in the chain against a hand-computed answer, and the chain's order."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runlm import sampling
from runlm.errors import InvalidInputError
from runlm.sampling import (
    Sampler,
    SamplingParams,
    apply_penalties,
    filter_logits,
    make_generator,
    sample,
    token_logprob,
)

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    weights = np.exp(logits.astype(np.float64) - logits.max())
    return weights / weights.sum()


def kept(params: SamplingParams, logits: np.ndarray = LOGITS, history=()) -> list[int]:
    return np.flatnonzero(np.isfinite(filter_logits(logits, params, history))).tolist()


def test_top_k():
    assert kept(SamplingParams(top_k=2)) == [0, 1]
    assert kept(SamplingParams(top_k=0)) == list(range(6))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = softmax(LOGITS)
    p = float(probs[0] + probs[1]) - 1e-4  # the first two just reach it
    assert kept(SamplingParams(top_p=p)) == [0, 1]
    assert kept(SamplingParams(top_p=float(probs[0]) / 2)) == [0]  # always at least one


def test_min_p_is_relative_to_the_best_token():
    # p_i / p_max = exp(l_i - l_max): 1, e^-1=.37, e^-1.5=.22, e^-2=.14, ...
    assert kept(SamplingParams(min_p=0.2)) == [0, 1, 2]
    assert kept(SamplingParams(min_p=0.5)) == [0]


def test_typical_p_keeps_tokens_near_the_entropy():
    logits = np.array([3.0, 2.9, 2.8, -5.0], dtype=np.float32)
    out = kept(SamplingParams(typical_p=0.5), logits)
    assert 3 not in out and len(out) >= 1


def test_temperature_scales_what_survives_and_zero_is_greedy():
    scaled = filter_logits(LOGITS, SamplingParams(temperature=0.5))
    assert np.allclose(scaled, LOGITS / 0.5)
    gen = make_generator(0)
    assert all(sample(LOGITS, SamplingParams(temperature=0.0), gen) == 0 for _ in range(5))


def test_truncation_sees_the_temperature_one_distribution():
    # llama.cpp order: top-p runs before temperature, so a huge temperature does not widen the top-p set.
    probs = softmax(LOGITS)
    p = float(probs[0]) - 1e-4
    assert kept(SamplingParams(top_p=p, temperature=100.0)) == [0]


def test_penalties_follow_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0, 1.0], dtype=np.float32)
    params = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, penalty_last_n=3)
    out = logits.copy()
    apply_penalties(out, [3, 0, 1, 1], params)  # window = [0, 1, 1]; token 3 fell out of it
    assert out.tolist() == pytest.approx([2.0 / 2 - 0.5 - 0.25, -2.0 * 2 - 1.0 - 0.25, 1.0, 1.0])


def test_logit_bias_applies_before_everything():
    assert kept(SamplingParams(top_k=1, logit_bias={5: 10.0})) == [5]


def test_seeded_sampler_is_reproducible_and_matches_the_distribution():
    params = SamplingParams(temperature=1.0, seed=7)
    s1, s2 = Sampler(params, 6), Sampler(params, 6)
    assert [s1(LOGITS) for _ in range(50)] == [s2(LOGITS) for _ in range(50)]
    counts = np.zeros(6)
    s = Sampler(SamplingParams(seed=1), 6)
    for _ in range(4000):
        counts[s(LOGITS)] += 1
    assert np.allclose(counts / 4000, softmax(LOGITS), atol=0.03)


def test_allowed_mask_is_respected():
    allowed = np.array([False, False, False, True, True, False])
    s = Sampler(SamplingParams(seed=3), 6)
    assert {s(LOGITS, allowed) for _ in range(50)} <= {3, 4}
    assert sample(LOGITS, SamplingParams(temperature=0), allowed=allowed) == 3


def test_logprobs_are_raw_log_softmax():
    lp = token_logprob(LOGITS, 2, top_n=2)
    ref = np.log(softmax(LOGITS))
    assert math.isclose(lp.logprob, float(ref[2]), rel_tol=1e-6)
    assert [t.token_id for t in lp.top] == [0, 1]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=-1),
        SamplingParams(top_p=1.5),
        SamplingParams(min_p=-0.1),
        SamplingParams(top_logprobs=21),
        SamplingParams(logit_bias={6: 1.0}),
        SamplingParams(logit_bias={-1: 1.0}),
        SamplingParams(temperature=float("nan")),
        SamplingParams(repeat_penalty=0.0),
    ],
)
def test_invalid_params_raise_invalid_input(params):
    with pytest.raises(InvalidInputError):
        params.validate(6)


def test_torch_logits_and_masks_sample_as_numpy_ones():
    """The PyTorch path hands the sampler tensors: the same draws as from the numpy arrays of the same bits."""
    torch = pytest.importorskip("torch")
    params = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.02, top_k=5, seed=11, logprobs=True, top_logprobs=3)
    allowed = np.array([True, True, False, True, True, True])
    from_numpy, from_torch = Sampler(params, 6), Sampler(params, 6)
    draws = [(from_numpy(LOGITS, allowed), from_torch(torch.from_numpy(LOGITS), torch.from_numpy(allowed)))
             for _ in range(30)]
    assert all(a == b for a, b in draws) and 2 not in {a for a, _ in draws}
    assert from_numpy.logprob(LOGITS, 1) == from_torch.logprob(torch.from_numpy(LOGITS).double(), 1)


def test_top_p_on_a_large_vocabulary_matches_a_full_sort():
    """_top_p sorts only its candidates (the k best, k growing): the kept set is the full sort's."""
    logits = np.random.default_rng(0).standard_normal(50_000).astype(np.float32) * 4
    probs = sampling.softmax(logits)  # float32, as the chain sums them
    for p in (0.1, 0.5, 0.9, 0.999):
        order = np.argsort(-probs, kind="stable")
        expected = sorted(order[: int(np.searchsorted(np.cumsum(probs[order]), p)) + 1].tolist())
        assert kept(SamplingParams(top_p=p), logits) == expected
