"""Hostile model files for the fuzz test: a GGUF header editor, a seeded catalog of variants, and the worker
that loads them (run as a script, in a subprocess with a memory cap and a per-variant time limit).

The GGUF side reads and writes headers on its own (not with runlm's parser), so a variant is exactly the bytes
intended. SmolLM2 variants keep the real header and leave the tensor data as a sparse hole (zeros: no 98 MB
copy per variant); the tiny models' data is copied, so their variants run on real weights.

Worker protocol: `python hostile.py SPEC.json` prints `start I` before variant I and `done I {json}` after it;
a variant that started and never finished tells the parent how the process ended (signal, time limit).
"""

from __future__ import annotations

import faulthandler
import json
import random
import resource
import shutil
import struct
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import runlm
from runlm.errors import RunlmError

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
            U64: "<Q", I64: "<q", F64: "<d"}


def encode(vtype: int, value) -> bytes:
    """A GGUF value's bytes (without its type field); arrays are (item_type, items)."""
    if vtype == STRING:
        data = value if isinstance(value, bytes) else value.encode("utf-8")
        return struct.pack("<Q", len(data)) + data
    if vtype == ARRAY:
        item_type, items = value
        return struct.pack("<IQ", item_type, len(items)) + b"".join(encode(item_type, item) for item in items)
    return struct.pack(_FORMATS[vtype], value)


def _skip(buf: bytes, pos: int, vtype: int) -> int:
    if vtype == STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype == ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item_type in _FORMATS:
            return pos + count * struct.calcsize(_FORMATS[item_type])
        for _ in range(count):
            pos = _skip(buf, pos, item_type)
        return pos
    return pos + struct.calcsize(_FORMATS[vtype])


def _decode(buf: bytes, pos: int, vtype: int):
    if vtype == STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return buf[pos + 8 : pos + 8 + length].decode("utf-8", "replace")
    if vtype == ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        items = []
        for _ in range(count):
            items.append(_decode(buf, pos, item_type))
            pos = _skip(buf, pos, item_type)
        return item_type, items
    return struct.unpack_from(_FORMATS[vtype], buf, pos)[0]


@dataclass
class TensorEntry:
    name: str
    dims: list[int]  # GGUF order: the row length first
    ggml_type: int
    offset: int


@dataclass
class GGUFImage:
    """A GGUF file as editable parts: metadata entries (raw value bytes), tensor infos, and where its data lies."""

    source: Path
    version: int
    kv: list[tuple[str, int, bytes]]
    tensors: list[TensorEntry]
    data_start: int
    data_size: int
    sparse: bool = False  # write the data as a hole of zeros instead of copying it
    n_tensors: int | None = None  # forged counts (None: the real ones)
    n_kv: int | None = None

    @classmethod
    def read(cls, path: Path, sparse: bool = False) -> GGUFImage:
        with open(path, "rb") as handle:
            head = handle.read(64 << 20)
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        pos, kv = 24, []
        alignment = 32
        for _ in range(n_kv):
            (length,) = struct.unpack_from("<Q", head, pos)
            key = head[pos + 8 : pos + 8 + length].decode("utf-8")
            pos += 8 + length
            (vtype,) = struct.unpack_from("<I", head, pos)
            end = _skip(head, pos + 4, vtype)
            kv.append((key, vtype, head[pos + 4 : end]))
            if key == "general.alignment":
                alignment = _decode(head, pos + 4, vtype)
            pos = end
        tensors = []
        for _ in range(n_tensors):
            (length,) = struct.unpack_from("<Q", head, pos)
            name = head[pos + 8 : pos + 8 + length].decode("utf-8")
            pos += 8 + length
            (n_dims,) = struct.unpack_from("<I", head, pos)
            dims = list(struct.unpack_from(f"<{n_dims}Q", head, pos + 4))
            pos += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", head, pos)
            pos += 12
            tensors.append(TensorEntry(name, dims, ggml_type, offset))
        data_start = (pos + alignment - 1) // alignment * alignment
        return cls(path, version, kv, tensors, data_start, path.stat().st_size - data_start, sparse)

    # -- edits ---------------------------------------------------------------------------------
    def get(self, key: str):
        for k, vtype, raw in self.kv:
            if k == key:
                return _decode(raw, 0, vtype)
        return None

    def set(self, key: str, vtype: int, value) -> GGUFImage:
        raw = encode(vtype, value)
        for index, (k, _, _) in enumerate(self.kv):
            if k == key:
                self.kv[index] = (key, vtype, raw)
                return self
        self.kv.append((key, vtype, raw))
        return self

    def drop(self, key: str) -> GGUFImage:
        self.kv = [entry for entry in self.kv if entry[0] != key]
        return self

    def tensor(self, name: str) -> TensorEntry:
        return next(t for t in self.tensors if t.name == name)

    def arch(self) -> str:
        return self.get("general.architecture")

    # -- writing -------------------------------------------------------------------------------
    def header(self) -> bytes:
        parts = [b"GGUF", struct.pack("<IQQ", self.version,
                                      len(self.tensors) if self.n_tensors is None else self.n_tensors,
                                      len(self.kv) if self.n_kv is None else self.n_kv)]
        for key, vtype, raw in self.kv:
            parts += [encode(STRING, key), struct.pack("<I", vtype), raw]
        for t in self.tensors:
            parts += [encode(STRING, t.name), struct.pack("<I", len(t.dims)), struct.pack(f"<{len(t.dims)}Q", *t.dims),
                      struct.pack("<IQ", t.ggml_type, t.offset)]
        head = b"".join(parts)
        return head + b"\0" * (-len(head) % 32)

    def write(self, path: Path, edit: Callable[[bytearray], bytes] | None = None) -> Path:
        """Header (through `edit`, which may flip or cut bytes), then the tensor data (copied or a sparse hole)."""
        head = self.header()
        if edit is not None:
            head = edit(bytearray(head))
        with open(path, "wb") as out:
            out.write(head)
            if self.sparse:
                out.truncate(len(head) + self.data_size)
            else:
                with open(self.source, "rb") as src:
                    src.seek(self.data_start)
                    shutil.copyfileobj(src, out)
        return path


def cut_file(path: Path, size: int) -> Path:
    with open(path, "r+b") as handle:
        handle.truncate(size)
    return path


# -- the catalog ----------------------------------------------------------------------------------


LOADS = "<loads>"  # a targeted case that must load and run (a 2 MB token is odd, not invalid)


@dataclass
class Variant:
    """One hostile model: `build(workdir)` writes it and returns the path to load.

    `expect`: for targeted cases, a pattern the RunlmError's message must match, or LOADS; None for fuzzed ones
    (any RunlmError is fine). `must_load`: a broken projector next to a valid model must not stop it loading.
    """

    name: str
    build: Callable[[Path], Path]
    must_load: bool = False
    expect: str | None = None
    dtype: str = "auto"


def _gguf_variant(base: Path, name: str, change: Callable[[GGUFImage], object], *, sparse: bool,
                  edit: Callable[[bytearray], bytes] | None = None, expect: str | None = None,
                  dtype: str = "auto") -> Variant:
    def build(workdir: Path) -> Path:
        image = GGUFImage.read(base, sparse=sparse)
        change(image)
        return image.write(workdir / "variant.gguf", edit)

    return Variant(name, build, expect=expect, dtype=dtype)


def hyperparameter_cases(base: Path, label: str, sparse: bool) -> list[Variant]:
    """One variant per value the issue measured (and its neighbours): each must be refused, naming the key."""
    u32_max, big = (1 << 32) - 1, 1 << 40
    cases: list[tuple[str, str, int, object, str]] = [
        # (name, key under the architecture, GGUF type, value, pattern the error must match)
        ("head_count 0", "attention.head_count", U32, 0, r"attention\.head_count is 0"),
        ("head_count u32 max", "attention.head_count", U32, u32_max, r"attention\.head_count is 4294967295"),
        ("head_count_kv 0", "attention.head_count_kv", U32, 0, r"head_count_kv is 0"),
        ("head_count_kv not a divisor", "attention.head_count_kv", U32, 7, r"head_count_kv is 7, expected a divisor"),
        ("key_length 0", "attention.key_length", U32, 0, r"key_length is 0"),
        ("key_length odd", "attention.key_length", U32, 15, r"key_length is 15, expected an even"),
        ("embedding_length 0", "embedding_length", U32, 0, r"embedding_length is 0"),
        ("embedding_length huge", "embedding_length", U64, big, r"embedding_length is 1099511627776"),
        ("feed_forward_length 0", "feed_forward_length", U32, 0, r"feed_forward_length is 0"),
        ("block_count 0", "block_count", U32, 0, r"block_count is 0"),
        ("block_count u32 max", "block_count", U32, u32_max, r"block_count is 4294967295"),
        ("context_length 0", "context_length", U32, 0, r"context_length is 0"),
        ("context_length 2^40", "context_length", U64, big, r"context_length is 1099511627776"),
        ("vocab_size 0", "vocab_size", U32, 0, r"vocab_size is 0"),
        ("vocab_size mismatch", "vocab_size", U32, 7, r"vocab_size is 7|tokenizer has \d+ tokens"),
        ("negative head_count", "attention.head_count", I32, -4, r"attention\.head_count is -4"),
        ("string head_count", "attention.head_count", STRING, "9", r"head_count is '9', expected an integer"),
        ("float head_count", "attention.head_count", F32, 9.0, r"head_count is 9\.0, expected an integer"),
        ("bool block_count", "block_count", BOOL, True, r"block_count is True, expected an integer"),
        ("string rms eps", "attention.layer_norm_rms_epsilon", STRING, "1e-5", r"epsilon is '1e-5'"),
        ("zero rms eps", "attention.layer_norm_rms_epsilon", F32, 0.0, r"epsilon is 0\.0"),
        ("nan rope base", "rope.freq_base", F32, float("nan"), r"freq_base is nan"),
        ("negative rope base", "rope.freq_base", F32, -1.0, r"freq_base is -1\.0"),
        ("yarn without its original context", "rope.scaling.type", STRING, "yarn",
         r"lacks llama\.rope\.scaling\.original_context_length"),
        ("longrope scaling", "rope.scaling.type", STRING, "longrope", r"rope scaling 'longrope' is not supported"),
        ("linear scaling factor 0", "rope.scaling.type", STRING, "linear", r"factor is 0\.0"),
    ]
    variants = []
    for name, key, vtype, value, pattern in cases:
        def change(image: GGUFImage, key=key, vtype=vtype, value=value, name=name) -> None:
            image.set(f"{image.arch()}.{key}", vtype, value)
            if name == "linear scaling factor 0":
                image.set(f"{image.arch()}.rope.scaling.factor", F32, 0.0)
            if name == "key_length odd":  # the rope dimension follows the key length in llama GGUFs
                image.set(f"{image.arch()}.rope.dimension_count", U32, 15)
        variants.append(_gguf_variant(base, f"{label}: {name}", change, sparse=sparse, expect=pattern))
    return variants


def gemma_cases(base: Path) -> list[Variant]:
    """Gemma 3's extras: sliding windows and their pattern."""
    cases = [
        ("sliding_window 0", "attention.sliding_window", U32, 0, r"sliding_window is 0"),
        ("sliding_window 2^27", "attention.sliding_window", U32, 1 << 27, r"sliding_window is 134217728"),
        ("sliding_window 2^40", "attention.sliding_window", U64, 1 << 40, r"sliding_window is 1099511627776"),
        ("sliding_window_pattern 0", "attention.sliding_window_pattern", U32, 0, r"sliding_window_pattern is 0"),
        ("sliding_window_pattern string", "attention.sliding_window_pattern", STRING, "6",
         r"sliding_window_pattern is '6'"),
        ("sliding_window_pattern short", "attention.sliding_window_pattern", ARRAY, (BOOL, [True]),
         r"sliding_window_pattern has 1 entries for 4 layers"),
        ("final softcap string", "final_logit_softcapping", STRING, "30", r"final_logit_softcapping is '30'"),
        ("swa rope base 0", "rope.freq_base_swa", F32, 0.0, r"freq_base_swa is 0\.0"),
    ]
    return [
        _gguf_variant(base, f"gemma3: {name}", lambda image, key=key, vtype=vtype, value=value:
                      image.set(f"{image.arch()}.{key}", vtype, value), sparse=False, expect=pattern)
        for name, key, vtype, value, pattern in cases
    ]


def header_cases(base: Path, label: str, sparse: bool) -> list[Variant]:
    """Forged counts, types, offsets and names in the header itself."""

    def nested(depth: int):
        value: tuple = (U8, [1])
        for _ in range(depth):
            value = (ARRAY, [value])
        return value

    def setter(**fields):
        return lambda image: [setattr(image, k, v) for k, v in fields.items()]

    def first_tensor(change):
        return lambda image: change(image.tensors[0])

    def duplicate(image: GGUFImage) -> None:
        image.tensors.append(TensorEntry(image.tensors[0].name, *(
            [list(image.tensors[1].dims), image.tensors[1].ggml_type, image.tensors[1].offset])))

    def duplicate_key(image: GGUFImage) -> None:
        image.kv.append(image.kv[0])

    cases: list[tuple[str, Callable[[GGUFImage], object], str]] = [
        ("version 1", setter(version=1), r"version 1 is not supported"),
        ("version 4", setter(version=4), r"version 4 is not supported"),
        ("big-endian version", setter(version=3 << 24), r"big-endian"),
        ("n_kv 2^63", setter(n_kv=1 << 63), r"declares \d+ metadata entries"),
        ("n_kv u64 max", setter(n_kv=(1 << 64) - 1), r"declares \d+ metadata entries"),
        ("n_tensors 2^62", setter(n_tensors=1 << 62), r"declares \d+ tensors"),
        ("n_tensors off by one", lambda image: setattr(image, "n_tensors", len(image.tensors) + 1), r"corrupt"),
        ("nested arrays 64 deep", lambda image: image.set("test.nested", ARRAY, nested(64)), r"nested deeper"),
        ("nested arrays 3 deep", lambda image: image.set("test.nested", ARRAY, nested(3)), LOADS),
        ("array count 2^62", lambda image: image.kv.append(("test.count", ARRAY, struct.pack("<IQ", U8, 1 << 62))),
         r"array of \d+ items runs past the end"),
        ("string array count 2^60", lambda image: image.kv.append(
            ("test.count", ARRAY, struct.pack("<IQ", STRING, 1 << 60))), r"array of \d+ items runs past the end"),
        ("string length 2^63", lambda image: image.kv.append(("test.text", STRING, struct.pack("<Q", 1 << 63))),
         r"string of \d+ bytes"),
        ("string array item length 2^64 - 1", lambda image: image.kv.append(
            ("test.texts", ARRAY, struct.pack("<IQQ", STRING, 2, (1 << 64) - 1) + b"\0" * 16)),
         r"array of 2 strings at byte \d+ runs past the end"),
        ("string array item past the end", lambda image: image.kv.append(
            ("test.texts", ARRAY, struct.pack("<IQQ", STRING, 1, 1 << 40))),
         r"array of 1 strings at byte \d+ runs past the end"),
        ("unknown value type", lambda image: image.kv.append(("test.kind", 13, b"\0" * 8)),
         r"'test\.kind'.*unknown value type 13"),
        ("unknown array item type", lambda image: image.kv.append(("test.kind", ARRAY, struct.pack("<IQ", 42, 1))),
         r"unknown value type 42"),
        ("duplicate key", duplicate_key, r"appears twice"),
        ("duplicate tensor name", duplicate, r"appears twice"),
        ("alignment 0", lambda image: image.set("general.alignment", U32, 0), r"general\.alignment is 0"),
        ("alignment 3", lambda image: image.set("general.alignment", U32, 3), r"general\.alignment is 3"),
        ("alignment string", lambda image: image.set("general.alignment", STRING, "32"), r"general\.alignment is '32'"),
        ("alignment 2^31", lambda image: image.set("general.alignment", U32, 1 << 31), r"truncated|offset"),
        ("tensor type unknown", first_tensor(lambda t: setattr(t, "ggml_type", 99)), r"unknown tensor type id 99"),
        ("tensor type IQ2_XXS", first_tensor(lambda t: setattr(t, "ggml_type", 16)),
         r"IQ2_XXS|does not fill|needs|truncated"),
        ("tensor type IQ2_XXS filling its blocks", lambda image: setattr(
            image.tensor("blk.0.ffn_down.weight"), "ggml_type", 16), r"stored as IQ2_XXS, a type runlm cannot read"),
        ("tensor 0 dims", first_tensor(lambda t: setattr(t, "dims", [])), r"0 dimensions"),
        ("tensor 5 dims", first_tensor(lambda t: setattr(t, "dims", [*t.dims, 1, 1, 1])), r"5 dimensions"),
        ("tensor dims overflow", first_tensor(lambda t: setattr(t, "dims", [t.dims[0], 1 << 62, 1 << 62])),
         r"overflow"),
        ("tensor dim 2^40", first_tensor(lambda t: setattr(t, "dims", [t.dims[0], 1 << 40])), r"truncated|shape"),
        ("tensor zero rows", first_tensor(lambda t: setattr(t, "dims", [t.dims[0], 0])), r"shape"),
        ("tensor offset misaligned", first_tensor(lambda t: setattr(t, "offset", t.offset + 1)),
         r"not a multiple of the alignment"),
        ("tensor offset past the end", first_tensor(lambda t: setattr(t, "offset", 1 << 40)), r"truncated"),
        ("tensor offset u64 max", first_tensor(lambda t: setattr(t, "offset", (1 << 64) - 32)), r"truncated"),
        ("architecture missing", lambda image: image.drop("general.architecture"), r"no general\.architecture"),
        ("architecture array", lambda image: image.set("general.architecture", ARRAY, (STRING, ["llama"])),
         r"no general\.architecture"),
        ("unknown architecture", lambda image: image.set("general.architecture", STRING, "mamba9"),
         r"'mamba9' is not supported"),
    ]
    return [_gguf_variant(base, f"{label}: {name}", change, sparse=sparse, expect=pattern)
            for name, change, pattern in cases]


def shape_cases(base: Path, label: str, sparse: bool) -> list[Variant]:
    """Tensor shapes that disagree with the hyperparameters (the header says one thing, the weights another)."""

    def swap_tensor(suffix: str, other: str):
        def change(image: GGUFImage) -> None:
            target = next(t for t in image.tensors if t.name.endswith(suffix))
            source = next(t for t in image.tensors if t.name.endswith(other))
            target.dims, target.ggml_type, target.offset = list(source.dims), source.ggml_type, source.offset
        return change

    cases = [
        ("q_proj shaped like k_proj", swap_tensor("blk.0.attn_q.weight", "blk.0.attn_k.weight"),
         r"'blk\.0\.attn_q\.weight' has shape"),
        ("ffn_down shaped like ffn_up", swap_tensor("blk.0.ffn_down.weight", "blk.0.ffn_up.weight"),
         r"'blk\.0\.ffn_down\.weight' has shape"),
        ("norm shaped like a matrix", swap_tensor("blk.0.attn_norm.weight", "blk.0.attn_k.weight"),
         r"'blk\.0\.attn_norm\.weight' has shape"),
        ("embedding rows off", lambda image: image.set(f"{image.arch()}.vocab_size", U32,
                                                       image.tensor("token_embd.weight").dims[1] + 1),
         r"(token_embd|output)\.weight' has shape"),  # the head (its vocabulary rows) may be read first
        ("missing tensor", lambda image: image.tensors.remove(image.tensor("blk.0.attn_v.weight")),
         r"missing tensor 'blk\.0\.attn_v\.weight'"),
    ]
    return [_gguf_variant(base, f"{label}: {name}", change, sparse=sparse, expect=pattern)
            for name, change, pattern in cases]


def tokenizer_cases(base: Path, label: str) -> list[Variant]:
    """Vocabularies that hang, or carry the wrong types."""
    giant = "x" * (2 << 20)

    def spm_giant(image: GGUFImage) -> None:
        tokens = image.get("tokenizer.ggml.tokens")[1]
        image.set("tokenizer.ggml.model", STRING, "llama").drop("tokenizer.ggml.merges")
        image.set("tokenizer.ggml.tokens", ARRAY, (STRING, [*tokens[:-1], giant]))

    def bpe_giant(image: GGUFImage) -> None:
        tokens = image.get("tokenizer.ggml.tokens")[1]
        image.drop("tokenizer.ggml.merges").set("tokenizer.ggml.tokens", ARRAY, (STRING, [*tokens[:-1], giant]))

    def tokens_as(item_type: int, value):
        return lambda image: image.set("tokenizer.ggml.tokens", ARRAY, (item_type, [value] * 300))

    cases = [
        ("SentencePiece vocabulary with one 2 MB token", spm_giant, LOADS),
        ("byte-level vocabulary with one 2 MB token, no merges", bpe_giant, LOADS),
        ("tokens as integers", tokens_as(I32, 7), r"tokenizer\.ggml\.tokens holds items that are not str"),
        ("token types as strings", lambda image: image.set(
            "tokenizer.ggml.token_type", ARRAY, (STRING, ["1"] * len(image.get("tokenizer.ggml.tokens")[1]))),
         r"token_type holds items that are not int"),
        ("merges as floats", lambda image: image.set("tokenizer.ggml.merges", ARRAY, (F32, [1.0, 2.0])),
         r"merges holds items that are not str"),
        ("merge without a space", lambda image: image.set("tokenizer.ggml.merges", ARRAY, (STRING, ["ab"])),
         r"malformed merge 'ab'"),
        ("pre as an array", lambda image: image.set("tokenizer.ggml.pre", ARRAY, (STRING, ["gpt2"])),
         r"tokenizer\.ggml\.pre is \['gpt2'\], expected a str"),
        ("unknown pre", lambda image: image.set("tokenizer.ggml.pre", STRING, "klingon"), r"'klingon'"),
        ("unknown tokenizer model", lambda image: image.set("tokenizer.ggml.model", STRING, "rwkv"), r"'rwkv'"),
        ("no vocabulary", lambda image: image.drop("tokenizer.ggml.tokens"), r"no tokenizer\.ggml\.tokens"),
        ("chat template of 100k nested ifs",
         lambda image: image.set("tokenizer.chat_template", STRING, "{% if 1 %}" * 100_000), r"chat template"),
    ]
    return [_gguf_variant(base, f"{label}: {name}", change, sparse=False, expect=pattern)
            for name, change, pattern in cases]


def truncations(base: Path, label: str, count: int, rng: random.Random, sparse: bool) -> list[Variant]:
    """The file cut at the interesting places (inside the counts, a key, the vocabulary, the tensor infos, the
    data) and at random ones."""
    image = GGUFImage.read(base)
    total = image.data_start + image.data_size
    points = [0, 4, 8, 20, 30, image.data_start // 2, image.data_start - 1, image.data_start + 1, total - 1]
    points += sorted(rng.randrange(1, total) for _ in range(max(0, count - len(points))))

    def variant(at: int) -> Variant:
        def build(workdir: Path) -> Path:
            img = GGUFImage.read(base, sparse=sparse)
            return cut_file(img.write(workdir / "variant.gguf"), at)
        return Variant(f"{label}: cut at byte {at}", build)

    return [variant(at) for at in points[:count]]


def byte_flips(base: Path, label: str, count: int, rng: random.Random, sparse: bool) -> list[Variant]:
    """Random bytes of the header replaced: half anywhere in it, half in its structure (the counts, the first
    entries' lengths and types, the tensor infos at its end), where a flip changes how the rest is read."""
    image = GGUFImage.read(base)
    head_len = len(image.header())
    infos = sum(8 + len(t.name) + 4 + 8 * len(t.dims) + 12 for t in image.tensors)
    variants = []
    for index in range(count):
        n = rng.choice((1, 1, 2, 4, 16))
        if index % 2:
            spots = [rng.randrange(0, head_len) for _ in range(n)]
        else:
            spots = [rng.choice((rng.randrange(4, 24), rng.randrange(24, min(head_len, 4096)),
                                 rng.randrange(max(0, head_len - infos - 32), head_len))) for _ in range(n)]
        values = [rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256))) for _ in spots]

        def edit(head: bytearray, spots=spots, values=values) -> bytes:
            for spot, value in zip(spots, values):
                head[spot] = value
            return bytes(head)

        variants.append(_gguf_variant(base, f"{label}: bytes {spots} -> {values}", lambda image: None,
                                      sparse=sparse, edit=edit, dtype=rng.choice(("auto", "f32"))))
    return variants


def mmproj_cases(vision_dir: Path, count: int, rng: random.Random) -> list[Variant]:
    """A broken mmproj*.gguf next to a valid text model: the model must load anyway (with a warning)."""
    projector = vision_dir / "mmproj-tiny.gguf"

    def beside(name: str, write_projector: Callable[[Path], object]) -> Variant:
        def build(workdir: Path) -> Path:
            model = workdir / "model" / "model.gguf"
            model.parent.mkdir()
            shutil.copyfile(vision_dir / "model.gguf", model)
            write_projector(model.parent / "mmproj-broken.gguf")
            return model
        return Variant(f"mmproj: {name}", build, must_load=True)

    image = GGUFImage.read(projector)
    size = image.data_start + image.data_size
    variants = [
        beside("empty", lambda path: path.write_bytes(b"")),
        beside("not a GGUF", lambda path: path.write_bytes(b"PK\x03\x04 a zip file")),
        beside("text model instead", lambda path: shutil.copyfile(vision_dir / "model.gguf", path)),
        beside("block_count string", lambda path: GGUFImage.read(projector).set(
            "clip.vision.block_count", STRING, "2").write(path)),
        beside("head_count 0", lambda path: GGUFImage.read(projector).set(
            "clip.vision.attention.head_count", U32, 0).write(path)),
        beside("image_size 2^31", lambda path: GGUFImage.read(projector).set(
            "clip.vision.image_size", U32, 1 << 31).write(path)),
        beside("feed_forward_length off", lambda path: GGUFImage.read(projector).set(
            "clip.vision.feed_forward_length", U32, 7).write(path)),
    ]
    for _ in range(count - len(variants)):
        at = rng.randrange(1, size)
        variants.append(beside(f"cut at byte {at}", lambda path, at=at: cut_file(
            GGUFImage.read(projector).write(path), at)))
    return variants


def hf_cases(hf_dir: Path, label: str, gemma: bool = False) -> list[Variant]:
    """Hugging Face directories: config.json values, the safetensors index, the tokenizer files."""

    def with_config(change: Callable[[dict], object]):
        def build(workdir: Path) -> Path:
            target = workdir / "hf"
            shutil.copytree(hf_dir, target)
            config = json.loads((target / "config.json").read_text())
            change(config.get("text_config", config))
            (target / "config.json").write_text(json.dumps(config))
            return target
        return build

    def with_files(change: Callable[[Path], object]):
        def build(workdir: Path) -> Path:
            target = workdir / "hf"
            shutil.copytree(hf_dir, target)
            change(target)
            return target
        return build

    def index_to(shard: str):
        def change(target: Path) -> None:
            (target / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": shard}}))
        return change

    def setter(key: str, value):
        return with_config(lambda config: config.__setitem__(key, value))

    cases: list[tuple[str, Callable[[Path], Path], str | None]] = [
        ("num_attention_heads string", setter("num_attention_heads", "4"), r"num_attention_heads is '4'"),
        ("num_attention_heads 0", setter("num_attention_heads", 0), r"num_attention_heads is 0"),
        ("num_attention_heads 2^32-1", setter("num_attention_heads", (1 << 32) - 1), r"num_attention_heads is 4294"),
        ("hidden_size float", setter("hidden_size", 64.5), r"hidden_size is 64\.5"),
        ("head_dim 0", setter("head_dim", 0), r"head_dim is 0"),
        ("num_hidden_layers -1", setter("num_hidden_layers", -1), r"num_hidden_layers is -1"),
        ("max_position 2^40", setter("max_position_embeddings", 1 << 40), r"max_position_embeddings is 1099"),
        ("rms eps string", setter("rms_norm_eps", "1e-6"), r"rms_norm_eps is '1e-6'"),
        ("yarn factor string", with_config(lambda c: (c.pop("rope_parameters", None), c.update(
            rope_theta=10000.0, rope_scaling={"rope_type": "yarn", "factor": "4"}))), r"yarn factor is '4'"),
        ("dynamic rope_scaling", with_config(lambda c: (c.pop("rope_parameters", None), c.update(
            rope_theta=10000.0, rope_scaling={"rope_type": "dynamic", "factor": 4.0}))), r"rope scaling 'dynamic'"),
        ("rope_scaling string", with_config(lambda c: (c.pop("rope_parameters", None), c.update(
            rope_scaling="linear"))), r"rope_scaling is 'linear', expected an object"),
        ("llama3 scaling without factors", with_config(lambda c: (c.pop("rope_parameters", None), c.update(
            rope_scaling={"rope_type": "llama3", "factor": 8.0}))), r"llama3 low_freq_factor is None"),
        ("config is a list", with_files(lambda t: (t / "config.json").write_text("[1, 2]")), r"expected a JSON object"),
        ("config not JSON", with_files(lambda t: (t / "config.json").write_text("{nope")), r"invalid JSON"),
        ("config not UTF-8", with_files(lambda t: (t / "config.json").write_bytes(b'{"a": "\xff"}')),
         r"invalid JSON"),
        ("index points outside", with_files(index_to("../../../etc/passwd")), r"not a file name inside"),
        ("index absolute path", with_files(index_to("/etc/passwd")), r"not a file name inside"),
        ("index not JSON", with_files(lambda t: (t / "model.safetensors.index.json").write_text("[")),
         r"not a safetensors index"),
        ("index weight_map a list", with_files(lambda t: (t / "model.safetensors.index.json").write_text(
            '{"weight_map": []}')), r"weight_map must map"),
        ("safetensors cut short", with_files(lambda t: cut_file(t / "model.safetensors", 4000)), r"safetensors"),
        ("safetensors header garbage", with_files(lambda t: (t / "model.safetensors").write_bytes(
            struct.pack("<Q", 1 << 40) + b"{}")), r"safetensors"),
        ("tokenizer.json garbage", with_files(lambda t: (t / "tokenizer.json").write_text("{}")), r"tokenizer"),
        ("added_tokens_decoder a list", with_files(lambda t: (t / "tokenizer_config.json").write_text(
            '{"added_tokens_decoder": [1]}')), r"added_tokens_decoder must be an object"),
    ]
    if gemma:
        cases += [
            ("sliding_window 2^40", setter("sliding_window", 1 << 40), r"config.json sliding_window is 1099511627776"),
            ("sliding_window_pattern 0", with_config(lambda c: (c.pop("layer_types", None), c.update(
                sliding_window_pattern=0))), r"sliding_window_pattern is 0"),
            ("layer_types short", setter("layer_types", ["full_attention"]), r"layer_types has 1 entries"),
            ("layer_types unknown", setter("layer_types", ["sliding_attention", "chunked", "full_attention", "x"]),
             r"layer_types holds 'chunked', 'x'"),
            ("query_pre_attn_scalar string", setter("query_pre_attn_scalar", "16"), r"query_pre_attn_scalar is '16'"),
        ]
    return [Variant(f"{label}: {name}", build, expect=pattern) for name, build, pattern in cases]


def targeted(bases: dict[str, str]) -> list[Variant]:
    """The named cases, each with the error it must raise (or LOADS); building them reads no file."""
    smol, tiny = Path(bases["smollm2"]), {k: Path(v) for k, v in bases.items() if k != "smollm2"}
    variants = hyperparameter_cases(smol, "smollm2", sparse=True)
    variants += header_cases(smol, "smollm2", sparse=True)
    variants += shape_cases(smol, "smollm2", sparse=True)
    variants += tokenizer_cases(tiny["gemma3"] / "model.gguf", "gemma3")
    variants += gemma_cases(tiny["gemma3"] / "model.gguf")
    for family in ("llama", "qwen3", "gemma3"):
        variants += shape_cases(tiny[family] / "model.gguf", family, sparse=False)
    variants += hyperparameter_cases(tiny["qwen3"] / "model.gguf", "qwen3", sparse=False)[:8]
    variants += hf_cases(tiny["llama"] / "hf", "hf llama")
    variants += hf_cases(tiny["gemma3"] / "hf", "hf gemma3", gemma=True)
    return variants


def catalog(bases: dict[str, str], seed: int) -> list[Variant]:
    """Every variant, in a fixed order for a given seed (the parent and the workers build the same list):
    the targeted cases, then seeded truncations and byte flips, then broken projectors beside a valid model."""
    rng = random.Random(seed)
    smol, tiny = Path(bases["smollm2"]), {k: Path(v) for k, v in bases.items() if k != "smollm2"}
    variants = targeted(bases)
    variants += truncations(smol, "smollm2", 24, rng, sparse=True)
    variants += byte_flips(smol, "smollm2", 40, rng, sparse=True)
    for family in ("llama", "qwen3", "gemma3"):
        variants += truncations(tiny[family] / "model-q4_0.gguf", f"{family} q4_0", 8, rng, sparse=False)
        variants += byte_flips(tiny[family] / "model.gguf", family, 24, rng, sparse=False)
        variants += byte_flips(tiny[family] / "model-q8_0.gguf", f"{family} q8_0", 8, rng, sparse=False)
    variants += mmproj_cases(tiny["vision"], 12, rng)
    return variants


# -- the worker -------------------------------------------------------------------------------------


def _exercise(loaded) -> None:
    """What a user does next: encode, prefill, decode a token, decode it to text."""
    ids = loaded.tokenizer.encode("Hello there") or [0]
    runner = loaded.runner
    session = runner.new_session()
    logits = runner.prefill(session, ids[:8])
    token = int(logits.argmax())
    runner.decode(session, token)
    loaded.tokenizer.decode([token])


def work(spec: dict) -> None:
    """Load each variant of spec["indices"] under a memory cap and a per-variant time limit, reporting each."""
    variants = catalog(spec["bases"], spec["seed"])
    cap = spec["memory_cap_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    for index in spec["indices"]:
        variant = variants[index]
        print(f"start {index}", flush=True)
        faulthandler.dump_traceback_later(spec["time_limit_s"], exit=True)
        outcome = {"name": variant.name}
        with tempfile.TemporaryDirectory(dir=spec["workdir"]) as workdir:
            try:
                path = variant.build(Path(workdir))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    loaded = runlm.load(path, dtype=variant.dtype)
                _exercise(loaded)
                del loaded
                outcome.update(status="ok", warnings=[str(w.message)[:200] for w in caught])
            except RunlmError as exc:
                outcome.update(status="refused", type=type(exc).__name__, message=str(exc)[:400])
            except BaseException as exc:  # noqa: BLE001 - the point: report anything that is not a RunlmError
                outcome.update(status="foreign", type=type(exc).__name__, message=str(exc)[:400],
                               where="".join(traceback.format_tb(exc.__traceback__)[-3:]))
            finally:
                faulthandler.cancel_dump_traceback_later()
        print(f"done {index} {json.dumps(outcome)}", flush=True)


if __name__ == "__main__":
    work(json.loads(Path(sys.argv[1]).read_text()))
