"""Random-weight GGUFs at the shapes people run, so speed and memory at 1B-3B can be measured without a download.

`ensure_shape("llama-1b", "Q4_K_M")` writes the model at F16 (F32 for norms and rope factors), streaming one
tensor at a time to disk, then quantizes it with llama.cpp's own quantizer (`llama_model_quantize` from
llama-cpp-python) and caches the result under `$RUNLM_HOME/shapes/`; the F16 intermediate is deleted, unless the
shape's F16 file is cached already: then that is quantized.

The numbers below are the published config.json values of each model (Hugging Face repos named in
`Shape.source`), cross-checked by parameter count:

| shape | arch | hidden | layers | heads/kv | head_dim | ffn | vocab | tied | rope | params |
|---|---|---|---|---|---|---|---|---|---|---|
| llama-1b | llama | 2048 | 16 | 32/8 | 64 | 8192 | 128,256 | yes | 5e5, llama3 (a) | 1,235,814,400 |
| llama-3b | llama | 3072 | 28 | 24/8 | 128 | 8192 | 128,256 | yes | 5e5, llama3 (a) | 3,212,749,824 |
| qwen3-1.7b | qwen3 | 2048 | 28 | 16/8 | 128 | 6144 | 151,936 | yes | 1e6 (q/k norms) | 1,720,574,976 |
| gemma3-1b | gemma3 | 1152 | 26 | 4/1 | 256 | 6912 | 262,144 | yes | 1e6 global, 1e4 local | 999,885,952 |
| qwen2.5-1.5b | qwen2 | 1536 | 28 | 12/2 | 128 | 8960 | 151,936 | yes | 1e6, QKV biases | 1,543,714,304 |
| phi-4-mini | phi3 | 3072 | 32 | 24/8 | 128 | 8192 | 200,064 | yes | 1e4, partial, LongRoPE (i) | 3,836,021,760 |
| gemma3-4b | gemma3 | 2560 | 34 | 8/4 | 256 | 10240 | 262,208 | yes | 1e6 linear x8 global, 1e4 local | 3,880,263,168 |
| gpt-oss-20b-6l | gpt-oss | 2880 | 6 (d) | 64/8 | 64 | 32x2880 (e) | 201,088 | no | 1.5e5, YaRN x32 | 6.10B |
| qwen3-30b-a3b-12l | qwen3moe | 2048 | 12 (b) | 32/4 | 128 | 128x768 (c) | 151,936 | no | 1e6 (q/k norms) | 8.10B |
| gemma4-31b-6l | gemma4 | 5376 | 6 (f) | 32/16, 32/4 | 256, 512 | 21504 | 262,144 | yes | 1e4, 1e6 (g) | 4.34B |
| gemma4-26b-a4b-6l | gemma4 | 2816 | 6 (h) | 16/8, 16/2 | 256, 512 | 2112 + 128x704 | 262,144 | yes | as (g) | 5.64B |

(a) llama3 rope scaling: factor 32, low_freq_factor 1, high_freq_factor 4, original context 8192, written as
the `rope_freqs` tensor as llama.cpp's converter does. rms_norm_eps 1e-5 (Llama), 1e-6 (Qwen3, Gemma 3).
(Llama 3.2 1B / 3B and Gemma 3 1B counts equal the published ones; Qwen3 1.7B's card says 1.7B, 1.4B
without the embedding.) Gemma 3 1B's rope_scaling is null (the linear x8 is only on 4B and up), its sliding
pattern is 5 local layers then 1 global, and query_pre_attn_scalar is 256 (= head_dim).

(b) Qwen3-30B-A3B has 48 layers; its shape keeps 12 (the disk holds its F16 intermediate; a token's work per layer
is the real model's, so its speed ratios hold). (c) 128 experts of 768 per layer, 8 used per token: 3.3B active
parameters per token at 48 layers (the embedding included), 1.3B at 12. Its router (`ffn_gate_inp`) is written at
F32, as llama.cpp's converter and quantizer keep it.

(d) gpt-oss-20b has 24 layers (its shape keeps 6, for the disk, as (b)); sliding windows of 128 in every other layer,
attention sinks, biases (written as zeros) on every projection. (e) 32 experts of 2880, 4 used per token, MXFP4 in its
released file (quantize with `MXFP4_MOE`: MXFP4 experts, Q8_0 elsewhere).

(f) Gemma 4 31B has 60 layers, five sliding-window ones (window 1024, heads of 256, 16 KV heads) to each global one
(heads of 512, 4 KV heads whose key projection gives the values too: no V weights); its shape keeps 6, one period.
(g) The global layers rotate a quarter of each head ("proportional" RoPE), written as llama.cpp's converter writes it:
a `rope_freqs` tensor of 1 for the rotated pairs and 1e30 for the rest. Final logits soft-capped at 30.
(h) Gemma 4 26B-A4B has 30 layers (numbers from its GGUF's metadata, which llama.cpp ships as
`models/ggml-vocab-gemma-4.gguf`); its shape keeps one period of 6. Each layer has a dense MLP of 2112 and 128
experts of 704 beside it, 8 used per token, its router on the residual with an input scale and a scale per expert.

(i) Phi-4-mini turns 96 of each head's 128 values; its LongRoPE stretches 4096 positions to 131072. Fused QKV and
gate/up projections, the short and long factors as `rope_factors_short` / `rope_factors_long` tensors and the
attention factor sqrt(1 + ln 32 / ln 4096), as llama.cpp's converter writes them (short factors 1, long ones rising
geometrically to 32: the real ones are learned). Qwen2.5's biases are written as zeros. Gemma 3 4B's window is 1024.

Tokenizer: the real SmolLM2 GGUF's `tokenizer.ggml.*` metadata (a 49,152-token byte-level BPE, chat
template included), padded to the shape's real vocabulary with `[PAD{i}]` tokens of type UNUSED, the way
llama.cpp's convert_hf_to_gguf.py pads a vocabulary. Padding, not shrinking, because the embedding and the
tied output head are a large share of the bytes read per token (21 % of Llama 3.2 1B, 30 % of Gemma 3 1B);
a 49k head would make these files faster than the models they stand for.

Weights are normal * 0.02 (norms 1, as stored in the GGUF), so the models run without NaNs; they are
for speed and memory, not for text.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from runlm.catalog import pull, runlm_home
from runlm.errors import CatalogError
from runlm.formats.gguf import GGUFFile

BUILDER_VERSION = 1  # part of each cached file's name: bump when the written file changes
TOKENIZER_SOURCE = "smollm2-135m"
UNUSED_TOKEN = int(gguf.TokenType.UNUSED)
FLOAT_TYPES = ("F32", "F16")
CHUNK = 1 << 24  # values drawn at a time: bounds the float32 scratch to 64 MB whatever the tensor


@dataclass(frozen=True)
class Shape:
    """One model's architecture numbers, as its config.json states them."""

    name: str
    arch: str  # GGUF architecture: llama, qwen3, gemma3
    source: str  # where the numbers come from
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    context: int
    rms_eps: float
    rope_theta: float
    tied: bool = True
    llama3_rope: tuple[float, float, float, int] | None = None  # factor, low_freq, high_freq, original context
    sliding_window: int | None = None  # gemma3: local layers' window; llama.cpp fixes the pattern at 5 local : 1
    yarn: tuple[float, int] | None = None  # YaRN's factor and original context (gpt-oss)
    experts: int = 0  # a mixture of experts in every block (qwen3moe): how many, how many a token uses, their width
    experts_used: int = 0
    expert_ffn: int = 0
    global_head_dim: int = 0  # gemma4: the global layers' heads and KV heads (the sliding ones' are head_dim, kv_heads)
    global_kv_heads: int = 0
    qkv_bias: bool = False  # qwen2: a bias on each of Q, K and V
    rotary_fraction: float = 0  # phi3: the share of each head RoPE turns (0: all of it)
    longrope_context: int = 0  # phi3: LongRoPE's original context, written with its per-frequency factors
    rope_linear: float = 0  # gemma3 4B and up: the global layers' linear RoPE factor
    scale: float = 0.02  # standard deviation of the random matrices

    def is_global(self, layer: int) -> bool:
        """gemma4: layer `layer` is a global-attention one (the sixth of each six, as llama.cpp's default pattern)."""
        return layer % 6 == 5

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(GGUF name, numpy shape) of every tensor, in file order."""
        yield "token_embd.weight", (self.vocab, self.hidden)
        if self.llama3_rope:
            yield "rope_freqs.weight", (self.head_dim // 2,)
        if self.arch == "gemma4":
            yield "rope_freqs.weight", (self.global_head_dim // 2,)
        if self.longrope_context:
            yield "rope_factors_long.weight", (self.rope_dims // 2,)
            yield "rope_factors_short.weight", (self.rope_dims // 2,)
        for i in range(self.layers):
            blk = f"blk.{i}."
            wide = self.arch == "gemma4" and self.is_global(i)
            head_dim = self.global_head_dim if wide else self.head_dim
            q, kv = self.heads * head_dim, (self.global_kv_heads if wide else self.kv_heads) * head_dim
            yield blk + "attn_norm.weight", (self.hidden,)
            if self.arch == "phi3":  # Q, K and V as one projection
                yield blk + "attn_qkv.weight", (q + 2 * kv, self.hidden)
            else:
                yield blk + "attn_q.weight", (q, self.hidden)
                yield blk + "attn_k.weight", (kv, self.hidden)
            if not wide and self.arch != "phi3":  # Gemma 4's global layers take their values from the key projection
                yield blk + "attn_v.weight", (kv, self.hidden)
            if self.qkv_bias:
                yield blk + "attn_q.bias", (q,)
                yield blk + "attn_k.bias", (kv,)
                yield blk + "attn_v.bias", (kv,)
            yield blk + "attn_output.weight", (self.hidden, q)
            if self.arch in ("qwen3", "qwen3moe", "gemma3", "gemma4"):
                yield blk + "attn_q_norm.weight", (head_dim,)
                yield blk + "attn_k_norm.weight", (head_dim,)
            if self.arch == "gpt-oss":
                yield from self._gpt_oss_extras(blk, q, kv)
                continue
            if self.arch in ("gemma3", "gemma4"):
                yield blk + "post_attention_norm.weight", (self.hidden,)
                yield blk + "post_ffw_norm.weight", (self.hidden,)
            if self.arch == "gemma4":
                yield blk + "layer_output_scale.weight", (1,)
            yield blk + "ffn_norm.weight", (self.hidden,)
            if self.experts and self.arch == "gemma4":  # the experts beside the dense MLP, each branch normed
                yield blk + "ffn_gate_inp.weight", (self.experts, self.hidden)
                yield blk + "ffn_gate_inp.scale", (self.hidden,)
                yield blk + "ffn_gate_up_exps.weight", (self.experts, 2 * self.expert_ffn, self.hidden)
                yield blk + "ffn_down_exps.weight", (self.experts, self.hidden, self.expert_ffn)
                yield blk + "ffn_down_exps.scale", (self.experts,)
                for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                    yield blk + f"{norm}.weight", (self.hidden,)
            elif self.experts:
                yield blk + "ffn_gate_inp.weight", (self.experts, self.hidden)
                yield blk + "ffn_gate_exps.weight", (self.experts, self.expert_ffn, self.hidden)
                yield blk + "ffn_up_exps.weight", (self.experts, self.expert_ffn, self.hidden)
                yield blk + "ffn_down_exps.weight", (self.experts, self.hidden, self.expert_ffn)
                continue
            if self.arch == "phi3":  # gate and up as one projection, gate first
                yield blk + "ffn_up.weight", (2 * self.ffn, self.hidden)
            else:
                yield blk + "ffn_gate.weight", (self.ffn, self.hidden)
                yield blk + "ffn_up.weight", (self.ffn, self.hidden)
            yield blk + "ffn_down.weight", (self.hidden, self.ffn)
        yield "output_norm.weight", (self.hidden,)
        if not self.tied:
            yield "output.weight", (self.vocab, self.hidden)

    def _gpt_oss_extras(self, blk: str, q: int, kv: int) -> Iterator[tuple[str, tuple[int, ...]]]:
        """The rest of a gpt-oss block: biases on every projection, the sinks, and its experts."""
        yield blk + "attn_q.bias", (q,)
        yield blk + "attn_k.bias", (kv,)
        yield blk + "attn_v.bias", (kv,)
        yield blk + "attn_output.bias", (self.hidden,)
        yield blk + "attn_sinks.weight", (self.heads,)
        yield blk + "post_attention_norm.weight", (self.hidden,)
        yield blk + "ffn_gate_inp.weight", (self.experts, self.hidden)
        yield blk + "ffn_gate_inp.bias", (self.experts,)
        for part, rows, cols in (("gate", self.expert_ffn, self.hidden), ("up", self.expert_ffn, self.hidden),
                                 ("down", self.hidden, self.expert_ffn)):
            yield blk + f"ffn_{part}_exps.weight", (self.experts, rows, cols)
            yield blk + f"ffn_{part}_exps.bias", (self.experts, rows)

    @property
    def rope_dims(self) -> int:
        """How many of each head's values RoPE turns (phi3's partial rotary: 96 of Phi-4-mini's 128)."""
        return int(self.head_dim * self.rotary_fraction) if self.rotary_fraction else self.head_dim

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for name, shape in self.tensors() if not name.startswith("rope_"))

    def digest(self) -> str:
        """Short hash of every number and the builder version: a changed shape never reuses a stale file."""
        numbers = {key: value for key, value in dataclasses.asdict(self).items()
                   if not (key in _ADDED_LATER and value == 0)}  # so files built before those fields keep their names
        text = json.dumps([BUILDER_VERSION, numbers], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:8]


LLAMA3_2_ROPE = (32.0, 1.0, 4.0, 8192)
# Shape fields a digest leaves out while they are 0
_ADDED_LATER = ("global_head_dim", "global_kv_heads", "qkv_bias", "rotary_fraction", "longrope_context", "rope_linear")

SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("llama-1b", "llama", "meta-llama/Llama-3.2-1B", hidden=2048, layers=16, heads=32, kv_heads=8,
              head_dim=64, ffn=8192, vocab=128256, context=131072, rms_eps=1e-5, rope_theta=500000.0,
              llama3_rope=LLAMA3_2_ROPE),
        Shape("llama-3b", "llama", "meta-llama/Llama-3.2-3B", hidden=3072, layers=28, heads=24, kv_heads=8,
              head_dim=128, ffn=8192, vocab=128256, context=131072, rms_eps=1e-5, rope_theta=500000.0,
              llama3_rope=LLAMA3_2_ROPE),
        Shape("qwen3-1.7b", "qwen3", "Qwen/Qwen3-1.7B", hidden=2048, layers=28, heads=16, kv_heads=8,
              head_dim=128, ffn=6144, vocab=151936, context=40960, rms_eps=1e-6, rope_theta=1000000.0),
        Shape("gemma3-1b", "gemma3", "google/gemma-3-1b-it", hidden=1152, layers=26, heads=4, kv_heads=1,
              head_dim=256, ffn=6912, vocab=262144, context=32768, rms_eps=1e-6, rope_theta=1000000.0,
              sliding_window=512),
        Shape("qwen2.5-1.5b", "qwen2", "Qwen/Qwen2.5-1.5B-Instruct", hidden=1536, layers=28, heads=12, kv_heads=2,
              head_dim=128, ffn=8960, vocab=151936, context=32768, rms_eps=1e-6, rope_theta=1000000.0,
              qkv_bias=True),
        Shape("phi-4-mini", "phi3", "microsoft/Phi-4-mini-instruct", hidden=3072, layers=32, heads=24, kv_heads=8,
              head_dim=128, ffn=8192, vocab=200064, context=131072, rms_eps=1e-5, rope_theta=10000.0,
              sliding_window=262144, rotary_fraction=0.75, longrope_context=4096),
        Shape("gemma3-4b", "gemma3", "google/gemma-3-4b-it", hidden=2560, layers=34, heads=8, kv_heads=4,
              head_dim=256, ffn=10240, vocab=262208, context=131072, rms_eps=1e-6, rope_theta=1000000.0,
              sliding_window=1024, rope_linear=8.0),
        Shape("gpt-oss-20b-6l", "gpt-oss", "openai/gpt-oss-20b", hidden=2880, layers=6, heads=64, kv_heads=8,
              head_dim=64, ffn=2880, vocab=201088, context=131072, rms_eps=1e-5, rope_theta=150000.0, tied=False,
              sliding_window=128, experts=32, experts_used=4, expert_ffn=2880, yarn=(32.0, 4096)),
        Shape("qwen3-30b-a3b-12l", "qwen3moe", "Qwen/Qwen3-30B-A3B", hidden=2048, layers=12, heads=32, kv_heads=4,
              head_dim=128, ffn=6144, vocab=151936, context=40960, rms_eps=1e-6, rope_theta=1000000.0, tied=False,
              experts=128, experts_used=8, expert_ffn=768),
        Shape("gemma4-31b-6l", "gemma4", "google/gemma-4-31B-it", hidden=5376, layers=6, heads=32, kv_heads=16,
              head_dim=256, ffn=21504, vocab=262144, context=262144, rms_eps=1e-6, rope_theta=1000000.0,
              sliding_window=1024, global_head_dim=512, global_kv_heads=4),
        Shape("gemma4-26b-a4b-6l", "gemma4", "google/gemma-4-26B-A4B-it", hidden=2816, layers=6, heads=16,
              kv_heads=8, head_dim=256, ffn=2112, vocab=262144, context=262144, rms_eps=1e-6, rope_theta=1000000.0,
              sliding_window=1024, global_head_dim=512, global_kv_heads=2, experts=128, experts_used=8,
              expert_ffn=704),
    )
}


def lookup_shape(name: str) -> Shape:
    shape = SHAPES.get(name)
    if shape is None:
        raise CatalogError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return shape


def shapes_dir() -> Path:
    """Where built shapes are cached: $RUNLM_HOME/shapes."""
    return runlm_home() / "shapes"


def llama_ftypes() -> dict[str, int]:
    """llama.cpp's file types by short name (Q4_K_M, Q8_0, ...); empty without llama-cpp-python."""
    try:
        import llama_cpp  # optional: the quantizer
    except ImportError:
        return {}
    prefix = "LLAMA_FTYPE_MOSTLY_"
    return {name.removeprefix(prefix): value for name, value in vars(llama_cpp).items() if name.startswith(prefix)}


def shape_path(shape: Shape, quant: str, directory: Path | None = None) -> Path:
    return (directory or shapes_dir()) / f"{shape.name}-{quant}-{shape.digest()}.gguf"


def ensure_shape(shape: Shape | str, quant: str = "Q4_K_M", threads: int | None = None,
                 progress: bool = True, directory: Path | None = None) -> Path:
    """The cached GGUF of `shape` at `quant` (in `directory`, default `shapes_dir()`), built on first use;
    F16 and F32 need no llama.cpp."""
    shape = lookup_shape(shape) if isinstance(shape, str) else shape
    quant = quant.upper()
    target = shape_path(shape, quant, directory)
    if target.is_file():
        return target
    ftypes = {} if quant in FLOAT_TYPES else llama_ftypes()
    if quant not in FLOAT_TYPES and quant not in ftypes:
        if not ftypes:
            raise CatalogError(f"quantizing to {quant} needs llama.cpp's quantizer: pip install llama-cpp-python "
                               f"(F16 and F32 are written without it)")
        raise CatalogError(f"unknown quantization {quant!r}; known: {', '.join(FLOAT_TYPES + tuple(ftypes))}")
    target.parent.mkdir(parents=True, exist_ok=True)
    float_type = "F32" if quant == "F32" else "F16"
    staged = target.with_name(target.name + ".partial")
    intermediate = staged if quant in FLOAT_TYPES else target.with_name(f"{target.stem}.{float_type}.partial")
    cached_float = shape_path(shape, float_type, directory)
    reused = quant not in FLOAT_TYPES and cached_float.is_file()
    if reused:  # the same weights (one seed) at F16 already: quantized from there
        intermediate = cached_float
    try:
        if not reused:
            if progress:
                print(f"runlm: writing {shape.name} ({shape.parameter_count() / 1e9:.2f}B random weights) at "
                      f"{float_type} ...", file=sys.stderr, flush=True)
            write_shape(shape, intermediate, float_type)
        if quant not in FLOAT_TYPES:
            if progress:
                print(f"runlm: quantizing to {quant} with llama.cpp's quantizer ...", file=sys.stderr, flush=True)
            quantize(intermediate, staged, ftypes[quant], threads or os.cpu_count() or 1)
        staged.replace(target)
    finally:
        if not reused:
            intermediate.unlink(missing_ok=True)
        staged.unlink(missing_ok=True)
    return target


def quantize(source: Path, target: Path, ftype: int, threads: int) -> None:
    """llama.cpp's own quantizer (its mixes: Q4_K_M keeps some tensors at Q6_K, as real files do)."""
    import llama_cpp  # optional: the quantizer

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    # llama.cpp logs a line per tensor, from C to fd 2 or through llama-cpp-python's callback to sys.stderr
    # (which drops errors once a Llama(verbose=False) has run: hence the level): all go to a file, read back
    # only to explain a failure.
    relay = logging.getLogger("llama-cpp-python")
    level = relay.level
    with tempfile.TemporaryFile(mode="w+", errors="replace") as log, contextlib.redirect_stderr(log):
        sys.__stderr__.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        relay.setLevel(logging.DEBUG)
        try:
            status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
        finally:
            relay.setLevel(level)
            log.flush()
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        tail = log.read().strip().splitlines()[-3:]
    if status != 0 or not target.is_file():
        raise CatalogError(f"llama.cpp could not quantize {source.name} (status {status}): {' / '.join(tail)}")


def write_shape(shape: Shape, path: Path, float_type: str = "F16", seed: int = 0) -> None:
    """Write `shape` with random weights; matrices at `float_type`, vectors at F32, one tensor in memory at a
    time (the header is written first from the shapes alone)."""
    tokenizer = GGUFFile(pull(TOKENIZER_SOURCE, progress=False)).metadata
    tokens = tokenizer["tokenizer.ggml.tokens"]
    if shape.vocab < len(tokens):
        raise CatalogError(f"shape {shape.name}: vocab {shape.vocab} is smaller than the tokenizer's {len(tokens)}")
    matrix_dtype = np.float16 if float_type == "F16" else np.float32
    writer = gguf.GGUFWriter(str(path), shape.arch)
    _write_metadata(writer, shape, float_type)
    _write_tokenizer(writer, tokenizer, shape.vocab)
    plan = list(shape.tensors())
    for name, dims in plan:
        dtype = np.float32 if _kept_f32(name, dims) else matrix_dtype
        writer.add_tensor_info(name, dims, np.dtype(dtype), math.prod(dims) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in plan:
        dtype = np.float32 if _kept_f32(name, dims) else matrix_dtype
        writer.write_tensor_data(_tensor_values(shape, name, dims, dtype, rng))
    writer.close()


def _kept_f32(name: str, dims: tuple[int, ...]) -> bool:
    """Vectors (norms, rope factors), biases and routers stay float32 in real files."""
    return len(dims) == 1 or name.endswith(("ffn_gate_inp.weight", ".bias", ".scale"))


def _tensor_values(shape: Shape, name: str, dims: tuple[int, ...], matrix_dtype, rng) -> np.ndarray:
    if name == "rope_freqs.weight" and shape.arch == "gemma4":  # a quarter of each global head rotates
        rotated = shape.global_head_dim // 8
        return np.array([1.0] * rotated + [1e30] * (shape.global_head_dim // 2 - rotated), dtype=np.float32)
    if name == "rope_freqs.weight":
        return llama3_rope_factors(shape)
    if name == "rope_factors_long.weight":  # from 1 at the fastest frequency to the context's stretch at the slowest
        return np.geomspace(1.0, shape.context / shape.longrope_context, dims[0]).astype(np.float32)
    if name.endswith(".bias"):
        return np.zeros(dims, dtype=np.float32)
    if len(dims) == 1:  # norms: 1, the stored multiplier (Gemma's GGUF stores 1 + w too)
        return np.ones(dims, dtype=np.float32)
    out = np.empty(dims, dtype=matrix_dtype)
    flat = out.reshape(-1)
    for start in range(0, flat.size, CHUNK):
        stop = min(flat.size, start + CHUNK)
        values = rng.standard_normal(stop - start, dtype=np.float32)
        values *= shape.scale
        flat[start:stop] = values
    return out


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """The `rope_freqs` tensor llama.cpp's converter writes for llama3 rope scaling (per-frequency divisors)."""
    assert shape.llama3_rope is not None
    factor, low_freq, high_freq, original = shape.llama3_rope
    inv_freq = 1.0 / shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = original / low_freq, original / high_freq
    smooth = (original / wavelen - low_freq) / (high_freq - low_freq)
    mixed = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, mixed))
    return factors.astype(np.float32)


def _write_metadata(writer: gguf.GGUFWriter, shape: Shape, float_type: str) -> None:
    writer.add_name(f"random-weight {shape.name} shape ({shape.source})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if float_type == "F16" else gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    if shape.arch == "gemma4":
        _write_gemma4_metadata(writer, shape)
    else:
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_vocab_size(shape.vocab)
    if shape.arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(shape.rope_dims)
    if shape.longrope_context:  # as llama.cpp's converter writes Phi-3's LongRoPE (its factors are tensors)
        writer.add_rope_scaling_orig_ctx_len(shape.longrope_context)
        stretch = shape.context / shape.longrope_context
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(stretch) / math.log(shape.longrope_context)))
    if shape.rope_linear:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(shape.rope_linear)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    if shape.yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(shape.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(shape.yarn[1])
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
        if shape.arch in ("gemma3", "gemma4"):
            writer.add_rope_freq_base_swa(10000.0)


def _write_gemma4_metadata(writer: gguf.GGUFWriter, shape: Shape) -> None:
    """What llama.cpp's converter writes of Gemma 4's attention: per-layer KV heads, both head sizes, the pattern."""
    layers = range(shape.layers)
    writer.add_head_count_kv([shape.global_kv_heads if shape.is_global(i) else shape.kv_heads for i in layers])
    writer.add_key_length(shape.global_head_dim)
    writer.add_value_length(shape.global_head_dim)
    writer.add_key_length_swa(shape.head_dim)
    writer.add_value_length_swa(shape.head_dim)
    writer.add_rope_dimension_count(shape.global_head_dim)
    writer.add_rope_dimension_count_swa(shape.head_dim)
    writer.add_sliding_window_pattern([not shape.is_global(i) for i in layers])
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    writer.add_final_logit_softcapping(30.0)


def _write_tokenizer(writer: gguf.GGUFWriter, metadata: dict, vocab: int) -> None:
    """Every `tokenizer.*` key of the source GGUF, with the vocabulary padded to `vocab` entries."""
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if key == "tokenizer.ggml.tokens":
            value = list(value) + [f"[PAD{i}]" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [UNUSED_TOKEN] * (vocab - len(value))
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)  # token ids, as llama.cpp reads them
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, str(value))
