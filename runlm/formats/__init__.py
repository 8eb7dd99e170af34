"""File formats: named tensors plus configuration, nothing model-specific."""

from __future__ import annotations

from typing import Any

import torch


class WeightSource:
    """Named float tensors (HF names); GGUF sources can also hand out raw quantized rows."""

    path: Any

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def raw(self, name: str):
        """A RawTensor for quantized sources, None where the weights are plain floats."""
        return None
