"""runlm: run open language models locally, behind one runner contract."""

import importlib

from runlm.errors import (
    CatalogError,
    ContextOverflowError,
    DownloadError,
    InvalidInputError,
    ModelAccessError,
    ModelLoadError,
    ModelNotFoundError,
    RunlmError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedOperationError,
)


def lazy_exports(package: str, names: dict[str, str]):
    """A module `__getattr__` that imports each of `names` (name -> the module defining it) on first use: what
    brings PyTorch is not imported by a process that does without it (the native runtime)."""

    def __getattr__(name: str):
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_exports(__name__, {
    "LoadedModel": "runlm.pytorch.loading",
    "load": "runlm.runtime",
    "NativeLoaded": "runlm.native.runner",
    "ImageInput": "runlm.runner",
    "LmRunner": "runlm.runner",
    "Session": "runlm.runner",
    "SessionSnapshot": "runlm.runner",
})  # fmt: skip

__all__ = [
    "CatalogError",
    "ContextOverflowError",
    "DownloadError",
    "ImageInput",
    "InvalidInputError",
    "LmRunner",
    "LoadedModel",
    "ModelAccessError",
    "ModelLoadError",
    "ModelNotFoundError",
    "NativeLoaded",
    "RunlmError",
    "Session",
    "SessionSnapshot",
    "TokenizerError",
    "UnsupportedArchitectureError",
    "UnsupportedOperationError",
    "load",
]
__version__ = "0.1.0"
