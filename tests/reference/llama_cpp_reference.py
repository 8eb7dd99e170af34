"""llama.cpp (llama-cpp-python) as a reference model for the tests.

On CPUs with AMX, llama.cpp built for the machine it is installed on (what `pip install llama-cpp-python` does)
puts quantized weights in its AMX buffer type, and that path crashes the process (a segmentation fault in
llama-cpp-python 0.3.36, with AVX-512 AMX Xeons). There its extra buffer types are left off: the weights stay in
llama.cpp's plain CPU buffers and run on its vector kernels, which agree with the AMX ones to rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
