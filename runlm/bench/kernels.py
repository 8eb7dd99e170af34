"""`runlm bench --kernels`: each weight type's kernel timed at decode and prefill rows."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from runlm.bench.common import best_ms, machine
from runlm.catalog import resolve_model
from runlm.formats.gguf import GGUFFile
from runlm.pytorch import kernels
from runlm.pytorch.int4 import pack_linear


def run_kernel_bench(args, max_rows: int = 8192) -> int:
    """For one tensor of each (type, shape) of the model: M=1 (decode) and M=17 / 128 (prefill) timings of
    runlm's kernel, a float32 GEMM on the dequantized weight, and torch's int4 kernel where it applies."""
    if args.threads:
        torch.set_num_threads(args.threads)
    gguf = GGUFFile(resolve_model(args.model))
    picked: dict[tuple[str, tuple[int, ...]], str] = {}
    for name in gguf.tensor_names():
        raw = gguf.raw(name)
        if raw.type_name in kernels.KERNEL_TYPES and len(raw.shape) == 2:
            picked.setdefault((raw.type_name, raw.shape), name)
    kernels.available()  # builds or loads the kernels, so that build_info has something to say
    print(f"model: {gguf.path.name}   threads: {torch.get_num_threads()}   kernels: {kernels.build_info()}")
    print(f"machine: {machine()}   (ms, best of repeated runs; rows capped at {max_rows})")
    print("| tensor | type | shape | M | kernel | f32 GEMM | int4 bf16 | module (path) |")
    print("|---|---|---|---|---|---|---|---|")
    for (type_name, shape), name in sorted(picked.items()):
        raw = gguf.raw(name)
        rows = min(shape[0], max_rows)
        data = np.asarray(raw.data)[:rows]
        module = kernels.GGUFLinear.from_raw(type_name, data, (rows, shape[1]), interleave=True)  # as models load it
        weight = module.dequantized()
        int4 = pack_linear(type_name, data, (rows, shape[1]), torch.bfloat16)
        for m in (1, 17, 128):
            x = torch.randn(m, shape[1])
            t_auto = best_ms(lambda: module(x))  # noqa: B023 - timed right here
            saved, module.dense_min_rows = module.dense_min_rows, 1 << 30
            t_kernel = best_ms(lambda: module(x))  # noqa: B023
            module.dense_min_rows = saved
            t_f32 = best_ms(lambda: F.linear(x, weight))  # noqa: B023
            t_int4 = f"{best_ms(lambda: int4(x.bfloat16())):.3f}" if int4 is not None else "-"  # noqa: B023
            route = "dense" if m >= saved else "kernel"
            print(f"| {name} | {type_name} | {rows}x{shape[1]} | {m} | {t_kernel:.3f} | {t_f32:.3f} | {t_int4} | "
                  f"{t_auto:.3f} ({route}) |")
    return 0
