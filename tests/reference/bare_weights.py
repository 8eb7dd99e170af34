"""A GGUF of bare tensors, with no model around them, and a WeightReader over it: for the tests of how weights are
copied, regrouped or read in place, which need no family."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from runlm.formats.gguf import GGUFFile
from runlm.native.weights import WeightReader


def bare_weights(path: Path, tensors: dict[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]]
                 ) -> tuple[GGUFFile, WeightReader]:
    """The file at `path` holding `tensors` (a float array, or quantized blocks' bytes with their type), opened, and
    a reader of its weights (the parts a model's reader uses to copy them: no spec, config or shape checks)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            blocks, quant_type = tensor
            writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=quant_type)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    reader = WeightReader.__new__(WeightReader)
    reader.gguf, reader._scratch, reader._huge_pages, reader.small_pages = file, np.empty(0, dtype=np.uint8), True, []
    return file, reader
