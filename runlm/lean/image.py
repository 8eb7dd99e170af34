"""The lean image: a model as runlm's fused kernels run it, in one file the decode process maps.

`write` runs in a process with PyTorch: it takes a loaded model (the family files built it, regrouped its weights
for this CPU's kernels and fused its blocks) and writes every buffer the fused blocks, the embedding, the final
norm and the LM head read, each once, beside a JSON header that says where each is and how the blocks use them.
`read` maps the file with numpy only: the weights are the file's pages (shared, clean, never copied), so a decode
process holds the weights once and nothing else of the load.

Layout: MAGIC, the header's length (8 bytes, little-endian), the header (UTF-8 JSON), then the buffers, each at a
64-byte aligned offset from the start of the file.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runlm.errors import ModelLoadError
from runlm.quant.build import KERNEL_TYPES

if TYPE_CHECKING:
    import torch

    from runlm.loading import LoadedModel

MAGIC = b"RUNLM-LEAN\x00\x01"
VERSION = 1
_ALIGN = 64


class LeanRefusal(ModelLoadError):
    """The model cannot run without PyTorch (the message says why): a property of the model, not a failure."""


@dataclass
class Image:
    """A mapped lean image: the header, and each buffer as a numpy view of the map."""

    path: Path
    header: dict[str, Any]
    arrays: dict[str, np.ndarray]


class _Writer:
    """Collects buffers (each distinct tensor once) and the header entries that name them."""

    def __init__(self):
        self.buffers: list[tuple[str, np.ndarray]] = []
        self.names: dict[int, str] = {}  # data_ptr -> name, so a tied embedding / head is written once
        self.tensors: dict[str, dict[str, Any]] = {}

    def add(self, tensor: torch.Tensor, hint: str) -> str:
        array = tensor.detach().cpu().contiguous().numpy()
        key = tensor.data_ptr()
        if key in self.names:
            return self.names[key]
        name = f"{hint}.{len(self.buffers)}"
        self.names[key] = name
        self.buffers.append((name, array))
        self.tensors[name] = {"dtype": array.dtype.str, "shape": list(array.shape)}
        return name

    def weight(self, blocks: torch.Tensor, type_id: int, rows: int, hint: str) -> dict[str, Any]:
        return {"tensor": self.add(blocks, hint), "type": int(type_id), "rows": int(rows)}


def refusal(loaded: LoadedModel) -> str | None:
    """Why this model cannot run lean (None when it can): every block must run on the fused kernels."""
    from runlm.models.base import Embedding

    model = getattr(loaded.runner, "model", None)
    if model is None or getattr(model, "block_stack", None) is None:
        return ("not every block of this model runs on runlm's fused CPU kernels (those need GGUF quantized weights "
                "of the kernels' types, float32 activations on the CPU and no attention soft cap)")
    if loaded.runner.supports_multimodal():
        return "it has a vision tower, which runs on PyTorch"
    embed: Embedding = model.embed
    if embed.table is None and embed.head is None and embed.raw.type_name not in KERNEL_TYPES:
        return f"its token embedding is stored as {embed.raw.type_name}, which runlm's kernels do not read"
    return None


def write(loaded: LoadedModel, path: Path) -> None:
    """The image of `loaded` (a packed GGUF model whose every block is fused) at `path`, written atomically."""
    import torch

    from runlm.quant import kernels
    from runlm.quant.int4 import DenseLinear
    from runlm.quant.kernels import GGUFLinear

    if (why := refusal(loaded)) is not None:
        raise LeanRefusal(f"{loaded.path}: cannot run without PyTorch: {why}")
    model, config = loaded.runner.model, loaded.config
    out = _Writer()
    rope_index = {id(rope): i for i, rope in enumerate(model.ropes)}
    blocks = []
    for index, layer in enumerate(model.layers):
        fused = layer.fused
        (norms, eps, q_norm, k_norm, qkv, qkv_types, qkv_rows, o, o_type, gate_up, gate_up_types, gate_up_rows,
         down, down_type, gelu) = fused.weights  # fmt: skip
        n_heads, n_kv_heads, scale = fused.heads
        hint = f"blk{index}"
        blocks.append({
            "norms": [out.add(n, hint + ".norm") for n in norms],
            "eps": float(eps),
            "q_norm": out.add(q_norm, hint + ".q_norm") if q_norm is not None else None,
            "k_norm": out.add(k_norm, hint + ".k_norm") if k_norm is not None else None,
            "qkv": [out.weight(w, t, r, hint + ".qkv") for w, t, r in zip(qkv, qkv_types, qkv_rows)],
            "o": out.weight(o, o_type, config.hidden_size, hint + ".o"),
            "gate_up": [out.weight(w, t, r, hint + ".gate_up")
                        for w, t, r in zip(gate_up, gate_up_types, gate_up_rows)],
            "down": out.weight(down, down_type, config.hidden_size, hint + ".down"),
            "gelu": bool(gelu),
            "rope": rope_index[fused.rope],
            "window": int(fused.window),
            "ring": bool(config.is_sliding(index) and not loaded.runner.swa_full),
            "n_heads": int(n_heads),
            "n_kv_heads": int(n_kv_heads),
            "scale": float(scale),
        })  # fmt: skip
    head = model.head
    if isinstance(head, GGUFLinear):
        head_entry = {"kind": "blocks", **out.weight(head.blocks, head.type_id, head.out_features, "head")}
    elif isinstance(head, DenseLinear):
        head_entry = {"kind": "dense", "tensor": out.add(head.weight.float(), "head")}
    else:
        raise LeanRefusal(f"{loaded.path}: cannot run without PyTorch: its LM head is a {type(head).__name__}")
    embed = model.embed
    if embed.table is not None:
        embed_entry = {"kind": "dense", "tensor": out.add(embed.table.float(), "embed")}
    elif embed.head is not None:
        embed_entry = {"kind": "blocks", **out.weight(embed.head.blocks, embed.head.type_id, embed.head.out_features,
                                                      "embed")}
    else:
        raw = embed.raw
        blocks_of_file = torch.from_numpy(np.ascontiguousarray(raw.data))
        embed_entry = {"kind": "blocks", **out.weight(blocks_of_file, KERNEL_TYPES[raw.type_name], raw.shape[0],
                                                      "embed")}
    chat_template = loaded.chat_template
    header = {
        "version": VERSION,
        "family": loaded.family,
        "source": _source_stamp(loaded.path),
        "kernels": {"isa": kernels.isa(), "group_rows": {t: kernels.group_rows(t) for t in kernels.X4_TYPES}},
        "hidden": config.hidden_size,
        "vocab_size": config.vocab_size,
        "head_dim": config.head_dim,
        "num_kv_heads": config.num_kv_heads,
        "context": config.max_position,
        "embed_scale": model.embed_scale,
        "final_softcap": config.final_softcap,
        "final_norm": {"tensor": out.add(model.norm.scale, "norm"), "eps": float(model.norm.eps)},
        "ropes": [out.add(rope.inv_freq, "rope") for rope in model.ropes],
        "blocks": blocks,
        "embed": embed_entry,
        "head": head_entry,
        "chat_template": None if chat_template is None else {
            "source": chat_template.source, "bos_token": chat_template.bos_token,
            "eos_token": chat_template.eos_token, "name": chat_template.name,
        },
        "tensors": out.tensors,
    }
    _write_file(path, header, out.buffers)


def _source_stamp(path: Path) -> dict[str, Any]:
    """What identifies the model file an image was made from (a changed file makes a new image)."""
    stat = Path(path).stat()
    return {"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _write_file(path: Path, header: dict[str, Any], buffers: list[tuple[str, np.ndarray]]) -> None:
    # offsets first (they go in the header), from the header's size, which the offsets barely change: fixed point
    offsets: dict[str, int] = {}
    for _ in range(4):
        header["offsets"] = offsets
        text = json.dumps(header).encode()
        position = _aligned(len(MAGIC) + 8 + len(text))
        new = {}
        for name, array in buffers:
            new[name] = position
            position = _aligned(position + array.nbytes)
        if new == offsets:
            break
        offsets = new
    header["offsets"] = offsets
    text = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    with open(partial, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(text)) + text)
        for name, array in buffers:
            f.write(b"\x00" * (offsets[name] - f.tell()))
            f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
    os.replace(partial, path)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def read_header(path: Path) -> dict[str, Any]:
    """An image's header alone (OSError, ValueError where the file cannot be read as one; ModelLoadError where it is
    not an image)."""
    with open(path, "rb") as f:
        start = f.read(len(MAGIC) + 8)
        if len(start) < len(MAGIC) + 8 or start[: len(MAGIC)] != MAGIC:
            raise ModelLoadError(f"{path}: not a runlm lean image")
        (length,) = struct.unpack("<Q", start[len(MAGIC):])
        return json.loads(f.read(length))


def read(path: Path) -> Image:
    """Map an image (numpy only); a file that is not one, or of another version, raises ModelLoadError."""
    try:
        header = read_header(path)
        if header.get("version") != VERSION:
            raise ModelLoadError(f"{path}: a lean image of version {header.get('version')}, this runlm reads {VERSION}")
        whole = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read the lean image ({exc})") from exc
    arrays = {}
    for name, info in header["tensors"].items():
        dtype = np.dtype(info["dtype"])
        count = int(np.prod(info["shape"], dtype=np.int64))
        offset = header["offsets"][name]
        arrays[name] = whole[offset : offset + count * dtype.itemsize].view(dtype).reshape(info["shape"])
    return Image(path=Path(path), header=header, arrays=arrays)


__all__ = ["Image", "LeanRefusal", "read", "read_header", "refusal", "write"]
