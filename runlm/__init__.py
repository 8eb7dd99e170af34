"""runlm: run open language models locally, behind one runner contract."""

from runlm.errors import (
    CatalogError,
    ContextOverflowError,
    InvalidInputError,
    ModelLoadError,
    RunlmError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedOperationError,
)

# Imported on first use: they bring PyTorch, which runlm.lean's decode process does without.
_LAZY = {
    "LoadedModel": "runlm.loading",
    "load": "runlm.loading",
    "ImageInput": "runlm.runner",
    "LmRunner": "runlm.runner",
    "Session": "runlm.runner",
    "SessionSnapshot": "runlm.runner",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runlm' has no attribute {name!r}")


__all__ = [
    "CatalogError",
    "ContextOverflowError",
    "ImageInput",
    "InvalidInputError",
    "LmRunner",
    "LoadedModel",
    "ModelLoadError",
    "RunlmError",
    "Session",
    "SessionSnapshot",
    "TokenizerError",
    "UnsupportedArchitectureError",
    "UnsupportedOperationError",
    "load",
]
__version__ = "0.1.0"
