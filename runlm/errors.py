"""One exception hierarchy: every failure a user can meet is a RunlmError."""

from __future__ import annotations


class RunlmError(Exception):
    """Base class of every error runlm raises on purpose."""


class ModelLoadError(RunlmError):
    """A model file or directory is missing, corrupt, or not something runlm can read."""


class UnsupportedArchitectureError(ModelLoadError):
    """The file is readable but its model family is not one runlm implements."""


class UnsupportedOperationError(RunlmError):
    """The runner does not implement an optional part of the contract."""


class InvalidInputError(RunlmError, ValueError):
    """A caller passed an argument that can never be valid (empty prompt, bad token id...)."""


class ContextOverflowError(InvalidInputError):
    """The prompt plus the requested tokens do not fit the model's context."""


class TokenizerError(RunlmError):
    """A tokenizer or chat template could not be built or applied."""


class CatalogError(RunlmError):
    """A catalog model is unknown or could not be fetched / verified."""


class ModelNotFoundError(CatalogError):
    """There is no such model to pull: the repo does not exist (or is private), or holds no file of the
    quantization asked for."""


class ModelAccessError(CatalogError):
    """The model exists but its host refuses it without credentials: a gated Hub repo without HF_TOKEN."""


class DownloadError(CatalogError):
    """Fetching a model failed partway: the network, the disk, or a file that does not match its listed sha256."""
