"""The real catalog GGUFs against transformers on the same dequantized weights (f32 both sides).

transformers loads the GGUF itself (dequantizing with the gguf package), so the two
runtimes see identical weights and any difference is in the model code.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import pytest
import torch
from reference.hf_gguf import hf_causal_lm

from runlm.pytorch.loading import load

LOGIT_TOL = 2e-3  # max abs diff of f32 logits (magnitudes ~20-40): float summation order only
AGREEMENT = 0.98  # teacher-forced argmax agreement


def english_text() -> str:
    return resources.files("runlm").joinpath("data/GPL-3.txt").read_text()


def hf_reference(path):
    return hf_causal_lm(path)


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load(smollm2_gguf, dtype="f32"), hf_reference(smollm2_gguf)


@pytest.fixture(scope="module")
def gemma3(gemma3_gguf):
    return load(gemma3_gguf, dtype="f32"), hf_reference(gemma3_gguf)


def teacher_forced(loaded, reference, ids: list[int]) -> tuple[float, float]:
    """(argmax agreement, max abs logit diff) over every position of `ids`."""
    runner = loaded.runner
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
        got = runner.extend(runner.new_session(), ids, all_positions=True)
    want = want.numpy()
    agreement = float((want.argmax(-1) == got.argmax(-1)).mean())
    return agreement, float(np.abs(want - got).max())


def test_smollm2_greedy_matches_transformers(smollm2):
    loaded, reference = smollm2
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = loaded.tokenizer.encode(loaded.chat_template.render(messages), add_bos=False)
    got = loaded.runner.generate(ids, 32)
    want = reference.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids) :].tolist()
    n = min(len(got), len(want))  # transformers stops early at EOS
    assert got[:n] == want[:n]
    assert "Paris" in loaded.tokenizer.decode(got)
    agreement, diff = teacher_forced(loaded, reference, ids + got)
    assert agreement >= AGREEMENT and diff <= LOGIT_TOL, (agreement, diff)


def test_smollm2_teacher_forced_on_english(smollm2):
    loaded, reference = smollm2
    ids = loaded.tokenizer.encode(english_text()[:1500])[:300]
    agreement, diff = teacher_forced(loaded, reference, ids)
    assert agreement >= AGREEMENT and diff <= LOGIT_TOL, (agreement, diff)


def test_gemma3_teacher_forced_on_english(gemma3):
    loaded, reference = gemma3
    assert loaded.runner.family() == "gemma"
    ids = loaded.tokenizer.encode(english_text()[:4000])[:600]  # longer than the 512-token sliding window
    assert len(ids) > 512
    agreement, diff = teacher_forced(loaded, reference, ids)
    assert agreement >= AGREEMENT and diff <= LOGIT_TOL, (agreement, diff)


def test_gemma3_decode_across_window_matches_prefill(gemma3):
    loaded, _ = gemma3
    runner = loaded.runner
    ids = loaded.tokenizer.encode(english_text()[:4000])[:520]
    runner.prefill_logits(ids[:500])
    for token in ids[500:520]:
        stepped = runner.decode_logits(token)
    full = load_fresh_logits(loaded, ids[:520])
    assert np.abs(stepped - full).max() <= LOGIT_TOL


def load_fresh_logits(loaded, ids):
    return loaded.runner.prefill(loaded.runner.new_session(), ids)


def test_gemma3_chat_uses_builtin_turn_format(gemma3_gguf):
    loaded = load("gemma3-270m", dtype="f32")
    text = loaded.chat_template.render([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert loaded.tokenizer.encode("<end_of_turn>", add_bos=False)[0] in loaded.tokenizer.stop_ids
