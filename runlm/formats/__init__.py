"""File formats: named tensors plus configuration, nothing model-specific."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from runlm.errors import ModelLoadError

if TYPE_CHECKING:  # the GGUF header reader stays importable without torch (runlm.native)
    import torch

ShapeRule = Callable[[str], tuple[int, ...] | None]


class WeightSource:
    """Named float tensors (HF names); GGUF sources can also hand out raw quantized rows.

    `expect` (HF name -> the shape the model's hyperparameters call for, or None) lets a source refuse a tensor
    of the wrong shape before its data is read or copied.
    """

    path: Any
    expect: ShapeRule | None = None

    def check_shape(self, name: str, shape: tuple[int, ...], stored_as: str) -> None:
        want = self.expect(name) if self.expect is not None else None
        if want is not None and tuple(shape) != tuple(want):
            raise ModelLoadError(
                f"{self.path}: tensor {stored_as!r} has shape {list(shape)}, the model's hyperparameters "
                f"call for {list(want)}"
            )

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def raw(self, name: str):
        """A RawTensor for quantized sources, None where the weights are plain floats."""
        return None
