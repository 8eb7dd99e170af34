"""llama.cpp (llama-cpp-python) as a reference model for the tests.

On CPUs with AMX, llama.cpp built for the machine it is installed on (what `pip install llama-cpp-python` does)
puts quantized weights in its AMX buffer type, and that path crashes the process (a segmentation fault in
llama-cpp-python 0.3.36, with AVX-512 AMX Xeons). There its extra buffer types are left off: the weights stay in
llama.cpp's plain CPU buffers and run on its vector kernels, which agree with the AMX ones to rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from runlm.system import cpu_flags


def reference_llama(path: Path | str, n_ctx: int) -> Any:
    """A llama_cpp.Llama of `path` computing every position's logits, on 2 threads."""
    import llama_cpp.llama_cpp as low  # optional: the reference
    from llama_cpp import Llama

    default_params = low.llama_model_default_params

    def without_extra_buffers():
        params = default_params()
        params.use_extra_bufts = False
        return params

    if "amx_int8" in cpu_flags().split():
        low.llama_model_default_params = without_extra_buffers
    try:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False)
    finally:
        low.llama_model_default_params = default_params


def llama_cpp_greedy(path: Path | str, prompt: list[int], steps: int) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's logits at the prompt's positions and its greedy continuation of `steps` tokens."""
    llm = reference_llama(path, n_ctx=256)
    llm.eval(prompt)
    logits = np.array(llm.scores[: len(prompt)])
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(tokens[-1:])
    return logits, tokens


# A near tie, for the greedy agreement: runlm's logit of llama.cpp's token within this share of the position's logit
# spread (std) of its own top one. Each quantization's bound is what runlm and llama.cpp differ by on the same file
# (tests/test_shapes.py's BOUNDS: llama.cpp rounds activations to 8 bits inside its dot products); the tiny random
# models' top tokens are often closer than that (0.2-10% of the spread at the steps that differed).
TIES = {"F16": 0.1, "BF16": 0.1, "Q8_0": 0.1, **dict.fromkeys(
    ["Q2_K", "Q3_K_M", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"], 0.16)}


def check_greedy_agreement(logits: np.ndarray, continuation: list[int], tie: float, label: str) -> None:
    """At each step of llama.cpp's greedy continuation runlm's top token (reading the same tokens) is the one
    llama.cpp chose, or the two are a near tie in runlm's logits; at least 90% are the same token.

    Not 95%: on the tiny random models a change of rounding anywhere re-draws which steps flip. llama.cpp with a
    float32 KV cache picks 91-97% of the tokens it picks with its default float16 cache, on the same 4-bit files."""
    steps = np.arange(len(continuation))
    chosen = logits.argmax(-1)
    gaps = logits[steps, chosen] - logits[steps, continuation]
    agreement = (chosen == np.array(continuation)).mean()
    assert agreement >= 0.9, f"{label}: greedy agreement {agreement:.3f}"
    far = gaps > tie * logits.std(-1)
    assert not far.any(), f"{label}: steps {steps[far].tolist()} differ by more than a near tie: {gaps[far]}"
