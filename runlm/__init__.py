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
from runlm.loading import LoadedModel, load
from runlm.runner import ImageInput, LmRunner, Session, SessionSnapshot

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
