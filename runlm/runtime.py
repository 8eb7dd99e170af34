"""runlm.load(): a model's format, family and runtime, chosen without side effects.

A GGUF file on a CPU runs on the native runtime (runlm.native: the file's weights on runlm's C++ kernels, in a
process that never imports PyTorch). The PyTorch backend (runlm.pytorch.loading, the `torch` extra) runs what the native
runtime does not: Hugging Face directories, a GPU, the float32 reference (dtype "f32") and bf16, a vision tower,
full sliding-window caches, and models whose weights or features the fused blocks do not take (those fall back to
it, said through `note`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from runlm import catalog
from runlm.errors import InvalidInputError, ModelLoadError
from runlm.native import build
from runlm.runner import ServedModel

RUNTIMES = ("auto", "native", "torch")
TORCH_EXTRA = "pip install 'runlm[torch]'"


def gpu_visible() -> bool:
    """A GPU the PyTorch backend would run on by default (NVIDIA's driver lists one, or ROCm's device is there), seen
    without importing PyTorch."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (nvidia.is_dir() and any(nvidia.iterdir())) or Path("/dev/kfd").exists()


def torch_reasons(path: Path, *, dtype: str = "auto", device: str | None = None, mmproj: str | Path | None = None,
                  swa_full: bool = False, images: bool = False) -> list[str]:
    """Why these options need the PyTorch backend for the model at `path` (empty: the native runtime can take them;
    whether the model itself can is found when it loads)."""
    reasons = []
    if not path.is_file():
        reasons.append("a Hugging Face directory")
    if dtype != "auto":
        reasons.append(f"dtype {dtype}")
    if device not in (None, "cpu"):
        reasons.append(f"device {device}")
    elif device is None and gpu_visible():
        reasons.append("a GPU (give device 'cpu' to run on the CPU)")
    if mmproj is not None or images:
        reasons.append("images (the vision tower)")
    if swa_full:
        reasons.append("full sliding-window caches (swa_full)")
    if build.variant() == "off":
        reasons.append(f"{build.ENV_VAR}=0 (no C++ kernels)")
    return reasons


def load(
    name_or_path: str | Path | None = None,
    *,
    runtime: str = "auto",
    dtype: str = "auto",
    max_context: int | None = None,
    mmproj: str | Path | None = None,
    device: str | None = None,
    swa_full: bool = False,
    kv_type: str = "auto",
    threads: int | None = None,
    images: bool = False,
    note: Callable[[str], None] | None = None,
) -> ServedModel:
    """Load a GGUF file, a Hugging Face directory or a catalog model into a ready runner.

    `runtime` "auto" takes the native runtime wherever the model and the options allow it, else the PyTorch
    backend (with a line to `note` when a model the native runtime refuses falls back); "native" insists (an error
    says why it cannot); "torch" asks for the PyTorch backend. `images`: the caller will send images. The other
    options are runlm.pytorch.loading.load's; `threads` sets the kernels' threads.
    """
    if runtime not in RUNTIMES:
        raise InvalidInputError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if runtime != "torch":
        path = catalog.resolve_model(name_or_path)
        reasons = torch_reasons(path, dtype=dtype, device=device, mmproj=mmproj, swa_full=swa_full, images=images)
        if runtime == "native" and reasons:
            raise InvalidInputError(f"{path}: the native runtime cannot take {', '.join(reasons)}")
        if not reasons:
            from runlm.native.loader import load_native
            from runlm.native.weights import NativeRefusal

            try:
                return load_native(path, kv_type=kv_type, max_context=max_context, threads=threads,
                                   catalog_name=_catalog_name(name_or_path))
            except NativeRefusal as exc:
                if runtime == "native":
                    raise
                if note is not None:
                    note(f"runlm: {exc}; running on the PyTorch backend")
    return _torch_load(name_or_path, dtype=dtype, max_context=max_context, mmproj=mmproj, device=device,
                       swa_full=swa_full, kv_type=kv_type, threads=threads)


def _catalog_name(name_or_path: str | Path | None) -> str | None:
    return name_or_path if isinstance(name_or_path, str) and name_or_path in catalog.CATALOG else None


def require_torch(what: str) -> None:
    """Raise a one-line ModelLoadError naming the extra to install where PyTorch is not installed."""
    if importlib.util.find_spec("torch") is None:
        raise ModelLoadError(f"{what} needs PyTorch, which is not installed: {TORCH_EXTRA}")


def _torch_load(name_or_path, *, threads: int | None = None, **options) -> ServedModel:
    require_torch("this model or option (the PyTorch backend)")
    try:
        import torch

        from runlm.pytorch.loading import load as load_with_torch
    except ImportError as exc:
        raise ModelLoadError(f"the PyTorch backend cannot be imported ({exc}): {TORCH_EXTRA}") from exc

    if threads:
        torch.set_num_threads(threads)
    return load_with_torch(name_or_path, **options)


__all__ = ["RUNTIMES", "TORCH_EXTRA", "gpu_visible", "load", "require_torch", "torch_reasons"]
