"""The native runtime's model: a GGUF file's blocks on runlm's C++ kernels, one C call per forward, the KV caches as
numpy arrays. Built straight from the file and the family's spec (runlm.families): no PyTorch, no file of its own.

Each block runs in kernels.cpp's block_rows, the code the PyTorch backend's fused blocks run, on the same RoPE tables
(runlm.rope) and the same weight layouts (runlm.native.weights), so a token's logits are that backend's, bit for bit
(tests/native check it). Prompts go in chunks of PREFILL_CHUNK rows, as there.
"""

from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runlm.errors import ContextOverflowError, InvalidInputError, ModelLoadError
from runlm.families import for_gguf
from runlm.families.config import ModelConfig, check_config, default_attention_scale
from runlm.families.spec import ACTIVATIONS, EXPERT_GATINGS, FamilySpec
from runlm.formats.gguf import GGUFFile, find_mmproj
from runlm.native import build, library
from runlm.native.build import FLOAT_KERNEL_TYPES, Q8_0_BYTES, Q8_0_VALUES
from runlm.native.weights import NativeRefusal, Rows, WeightReader, huge_pages_later, table
from runlm.rope import rope_frequencies, rope_index, table_block

PREFILL_CHUNK = 256
# KV cache element types: numpy dtype of a row element, and kernels.cpp's KvType
KV_TYPES = {"f16": (np.float16, 1), "f32": (np.float32, 0), "q8_0": (np.uint8, 2)}


@dataclass
class NativeSession:
    """One sequence: its tokens and, per block, its key and value caches ([1, n_kv, capacity, row])."""

    tokens: list[int] = field(default_factory=list)
    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    capacity: int = 0  # positions the full (non-ring) caches hold now
    limit: int = 0  # positions they may grow to (NativeModel.reserve); the capacity for a session sized once
    _table: np.ndarray | None = field(default=None, repr=False)
    _tabled: list[np.ndarray] = field(default_factory=list, repr=False)  # the caches `_table` was made from

    def cache_table(self) -> np.ndarray:
        """Per block, its key cache's address, its value cache's and its slots: [3, blocks] int64, what the C call
        takes. Made again only where a cache was replaced (reserve grows them): ~500 addresses taken from numpy each
        step cost ~0.8 ms of SmolLM2's 15 ms 8-row decode step (2 threads, avx2)."""
        caches = self.keys + self.values
        if self._table is None or len(caches) != len(self._tabled) or any(
                a is not b for a, b in zip(caches, self._tabled)):
            self._table = np.array([[library.address(k) for k in self.keys],
                                    [library.address(v) for v in self.values],
                                    [k.shape[2] for k in self.keys]], dtype=np.int64)
            self._tabled = caches
        return self._table


@dataclass
class BlockShape:
    """What the Python side needs of a block: its cache's shape and kind."""

    n_kv_heads: int
    head_dim: int
    window: int  # 0: full attention
    ring: bool  # its cache is a ring of the window (or longer: `slots`)
    slots: int = 0  # a ring's length; at least the window
    shared: bool = False  # it attends over an earlier block's cache, and has none of its own


def model_config(gguf: GGUFFile) -> tuple[FamilySpec, ModelConfig]:
    """A GGUF model's family spec and its numbers, checked (nothing of its tensors read yet)."""
    spec = for_gguf(gguf.architecture, gguf.path)
    return spec, check_config(spec.config_from_gguf(gguf), str(gguf.path), "gguf", gguf.architecture)


def refusal(spec: FamilySpec, config: ModelConfig, path: Path) -> str | None:
    """Why a model cannot run on the native runtime, from its spec and numbers alone (None: nothing yet; its tensor
    types are checked as they are read)."""
    odd = sorted({d for d in map(config.layer_head_dim, range(config.num_layers)) if d % 8})
    if odd:
        return f"its heads have {odd[0]} values, not a multiple of 8"
    if spec.vision and find_mmproj(path):
        return f"a vision projector lies beside it ({find_mmproj(path)[0].name}), and its tower runs on PyTorch"
    return None


class NativeModel:
    """A GGUF model on the native runtime: forward passes over sessions, logits out (float32 numpy)."""

    def __init__(self, gguf: GGUFFile, kv_type: str = "f16", threads: int | None = None,
                 described: tuple[FamilySpec, ModelConfig] | None = None, max_context: int | None = None):
        """`described`: the file's model_config, where the caller has read it already. `max_context`: the most
        positions a session holds, below the model's own (LongRoPE picks its factors by it, as llama.cpp does)."""
        if kv_type not in KV_TYPES:
            raise InvalidInputError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        if build.variant() == "off":
            raise NativeRefusal(f"the native runtime needs runlm's C++ kernels, which {build.ENV_VAR}=0 turns off")
        self.path = gguf.path
        self.spec, self.config = described or model_config(gguf)
        config = self.config
        if (why := refusal(self.spec, config, gguf.path)) is not None:
            raise NativeRefusal(f"{gguf.path}: cannot run on the native runtime: {why}")
        lib = library.library()
        if threads:
            library.set_threads(threads)
        self.kv_dtype, self.kv_code = KV_TYPES[kv_type]
        self.hidden = config.hidden_size
        head_dims = {config.layer_head_dim(i) for i in range(config.num_layers)}
        if kv_type == "q8_0" and any(d % Q8_0_VALUES for d in head_dims):
            raise InvalidInputError(f"kv_type q8_0 needs a head dim that is a multiple of 32, not "
                                    f"{min(d for d in head_dims if d % Q8_0_VALUES)}")
        self.vocab_size = config.vocab_size
        self.context = min(config.max_position, max_context or config.max_position)
        reader = WeightReader(gguf, self.spec, config)
        try:
            self._build(lib, reader)
        except NativeRefusal as exc:
            raise NativeRefusal(f"{gguf.path}: cannot run on the native runtime: {exc}") from None
        # the weights that loaded in 4 KiB pages go into huge pages in idle time, until the model is let go
        self.huge_pages = huge_pages_later(reader.small_pages)
        if self.huge_pages is not None:
            weakref.finalize(self, self.huge_pages.stop)

    @classmethod
    def open(cls, path: str | Path, kv_type: str = "f16", threads: int | None = None) -> NativeModel:
        return cls(GGUFFile(path), kv_type, threads)

    def _build(self, lib, reader: WeightReader) -> None:
        """The blocks onto a C stack (one struct each), and the embedding, final norm and head beside it. The arrays
        the stack points into are kept here for its life."""
        spec, config = self.spec, self.config
        freq_factors = reader.floats("rope_freqs.weight") if reader.has("rope_freqs.weight") else None
        self.ropes = rope_frequencies(config, freq_factors, self.context)
        self._rope_widths = [2 * len(frequencies) for frequencies, _ in self.ropes]
        self._rope_widths_arg = library.int64s(self._rope_widths)
        self._rope_tables = [(np.empty((0, width), np.float32),) * 2 for width in self._rope_widths]
        self.stack = lib.rl_stack_new()
        weakref.finalize(self, lib.rl_stack_free, self.stack)
        self._kept: list[np.ndarray] = []
        self.blocks: list[BlockShape] = []
        for i in range(config.num_layers):
            self._add_block(lib, reader, i)
        self._rings_arg = library.int64s([int(block.ring) for block in self.blocks])
        self.per_layer = self._per_layer_inputs(reader) if config.per_layer_input else None
        eps = config.rms_eps
        self.final_norm, self.final_eps = reader.floats("model.norm.weight"), eps
        head_name = spec.head_name(reader.has("lm_head.weight"), config)
        self.head = table(reader, head_name, as_head=True)
        tied = head_name == "model.embed_tokens.weight"
        # a tied head's blocks serve the embedding's lookups too: one copy of the table, as on the PyTorch backend
        self.embed = self.head if tied else table(reader, "model.embed_tokens.weight", as_head=False)
        self.embed_scale = spec.embed_scale(config)
        self.final_softcap, self.logit_scale = config.final_softcap, config.logit_scale

    def _add_block(self, lib, reader: WeightReader, i: int) -> None:
        spec, config = self.spec, self.config
        p = f"model.layers.{i}."
        spec.refuse_unapplied(reader.has, i, self.path, config)
        norms = [None if name is None else self._address(reader.floats(p + name + ".weight"))
                 for name in spec.norm_names]
        source = config.kv_source(i)
        q_norm = self._address(reader.floats(p + "self_attn.q_norm.weight")) if spec.qk_norm else None
        k_norm = (self._address(reader.floats(p + "self_attn.k_norm.weight")) if spec.qk_norm and source is None
                  else None)
        # Gemma 4's full-attention layers may have no value projection: their keys' projection gives the values too;
        # its last layers have neither, and attend over an earlier layer's cache
        values_from_keys = spec.values_from_keys and not reader.has(p + "self_attn.v_proj.weight")
        qkv_names = spec.qkv_names(p)[: 1 if source is not None else 2 if values_from_keys else 3]
        qkv = reader.linear(qkv_names)
        qkv_bias = reader.bias(spec.qkv_names(p, "bias")[: len(qkv_names)])
        (o,) = reader.linear([p + "self_attn.o_proj.weight"])
        self._kept += [part.data for part in (*qkv, o)]
        o_bias = reader.bias([p + "self_attn.o_proj.bias"]) if spec.biases else None
        sinks = reader.floats(p + "self_attn.sinks.weight") if spec.attention_sinks else None
        if spec.experts and not config.num_experts and reader.has(p + "mlp.gate.weight"):
            raise ModelLoadError(f"{self.path}: layer {i} holds a router of experts, but the file's metadata names "
                                 f"no experts")
        mlp = self._experts(reader, p) if spec.experts and config.num_experts else self._dense_mlp(reader, p)
        if spec.experts_beside_mlp and config.num_experts:  # the experts beside a dense MLP, each normed
            mlp |= self._dense_mlp(reader, p) | self._gemma4_experts(reader, p)
        sliding = config.is_sliding(i)
        out_scale = 1.0
        if spec.layer_scalar and reader.has(p + "layer_scalar.weight"):
            (out_scale,) = reader.floats(p + "layer_scalar.weight").ravel().tolist()
            if not (np.isfinite(out_scale) and out_scale > 0):
                raise ModelLoadError(f"{self.path}: layer {i}'s output scale is {out_scale}, expected a positive "
                                     f"number")
        block = library.Block(
            norms=(ctypes.c_void_p * 4)(*norms), n_norms=len(norms), hidden=self.hidden, eps=config.rms_eps,
            q_norm=q_norm, k_norm=k_norm,
            qkv=(library.Weight * 3)(*(part.weight() for part in qkv)), n_qkv=len(qkv), o=o.weight(),
            **mlp, activation=ACTIVATIONS.index(spec.activation),
            rope=rope_index(config, i), window=config.sliding_window if sliding else 0,
            n_heads=config.num_heads, n_kv_heads=config.layer_kv_heads(i), scale=default_attention_scale(config),
            qkv_bias=self._address(qkv_bias),
            qk_norm_whole=int(spec.qk_norm_whole), residual_scale=config.residual_scale,
            attn_softcap=config.attn_softcap or 0.0, o_bias=self._address(o_bias), sinks=self._address(sinks),
            attn_temp_scale=config.attn_temperature, attn_temp_length=config.attn_temperature_length,
            values_from_keys=int(values_from_keys), value_norm=int(spec.value_norm), out_scale=out_scale,
            kv_source=-1 if source is None else source, **self._per_layer_block(reader, p),
        )  # fmt: skip
        library.check(lib.rl_stack_add_block(self.stack, ctypes.byref(block)))
        # a ring that a later block reads after this one stored a call's rows keeps a prefill chunk more
        read_later = any(config.kv_source(j) == i for j in range(i + 1, config.num_layers))
        slots = block.window + (PREFILL_CHUNK if read_later else 0)
        self.blocks.append(BlockShape(config.layer_kv_heads(i), config.layer_head_dim(i), block.window, sliding,
                                      slots if sliding else 0, source is not None))

    def _per_layer_block(self, reader: WeightReader, p: str) -> dict:
        """Gemma 4's per-layer input fields of library.Block (none where the model has no per-layer inputs)."""
        if not self.config.per_layer_input:
            return {}
        (gate,) = reader.linear([p + "per_layer_input_gate.weight"])
        (proj,) = reader.linear([p + "per_layer_projection.weight"])
        self._kept += [gate.data, proj.data]
        return dict(ple_gate=gate.weight(), ple_proj=proj.weight(), ple_dim=self.config.per_layer_input,
                    ple_norm=self._address(reader.floats(p + "post_per_layer_input_norm.weight")))

    def _per_layer_inputs(self, reader: WeightReader) -> tuple[Rows, Rows, np.ndarray]:
        """Gemma 4's per-layer input tables: the token's own embedding of every layer's input, the projection of the
        token's embedding into them, and the norm of each layer's projected part."""
        return (table(reader, "per_layer_token_embd.weight", as_head=False),
                table(reader, "per_layer_model_proj.weight", as_head=True), reader.floats("per_layer_proj_norm.weight"))

    def _dense_mlp(self, reader: WeightReader, p: str) -> dict:
        """A dense MLP's fields of library.Block."""
        gate_up_names = self.spec.gate_up_names(p)
        fields = self._mlp(reader, gate_up_names, p + "mlp.down_proj.weight")
        if self.spec.biases:
            gate_up_bias = reader.bias([name.removesuffix("weight") + "bias" for name in gate_up_names])
            fields.update(gate_up_bias=self._address(gate_up_bias),
                          down_bias=self._address(reader.bias([p + "mlp.down_proj.bias"])))
        return fields

    def _mlp(self, reader: WeightReader, gate_up_names: list[str], down_name: str, field: str = "") -> dict:
        """One gated MLP's weights as library.Block's fields (`field` + gate_up, n_gate_up, down): gate and up
        stacked (in one or two parts), and down."""
        gate_up = reader.linear(gate_up_names)
        (down,) = reader.linear([down_name])
        self._kept += [part.data for part in (*gate_up, down)]
        return {f"{field}gate_up": (library.Weight * 2)(*(part.weight() for part in gate_up)),
                f"n_{field}gate_up": len(gate_up), f"{field}down": down.weight()}

    def _experts(self, reader: WeightReader, p: str) -> dict:
        """A mixture of experts' fields of library.Block: the router and every expert's gate/up and down."""
        config = self.config
        router_name, gate_up_names, down_name = self.spec.expert_names(p)
        if reader.has(p + "mlp.experts.gate_up_proj.weight"):  # every expert's gate and up in one tensor
            gate_up_names = [p + "mlp.experts.gate_up_proj.weight"]
        (router,) = reader.linear([router_name])
        gate_ups = reader.experts(gate_up_names)
        downs = [parts[0] for parts in reader.experts([down_name])]
        per_expert = len(gate_ups[0])
        if any(len(parts) != per_expert for parts in gate_ups):
            raise NativeRefusal(f"its experts' gate and up weights in {p} are stored in different types")
        self._kept += [router.data, *(part.data for parts in gate_ups for part in parts),
                       *(part.data for part in downs)]
        return dict(
            n_experts=config.num_experts, n_experts_used=config.experts_per_token, router=router.weight(),
            expert_gate_up=(library.Weight * (per_expert * len(gate_ups)))(
                *(part.weight() for parts in gate_ups for part in parts)),
            n_expert_gate_up=per_expert, expert_down=(library.Weight * len(downs))(*(d.weight() for d in downs)),
            expert_gating=EXPERT_GATINGS.index(self.spec.experts), expert_normalize=int(config.expert_normalize),
            **(self._expert_biases(reader, p) if self.spec.biases else {}),
            **(self._shared_expert(reader, p) if self.spec.shared_expert else {}),
        )  # fmt: skip

    def _gemma4_experts(self, reader: WeightReader, p: str) -> dict:
        """Gemma 4's fields of library.Block beside its experts: their input and output norms and the dense MLP's
        output norm, the router's input scale and each expert's scale."""
        norms = [self._address(reader.floats(p + name + ".weight")) for name in (
            "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")]
        return dict(moe_norms=(ctypes.c_void_p * 3)(*norms),
                    router_scale=self._address(reader.floats(p + "mlp.gate.scale")),
                    expert_scales=self._address(reader.floats(p + "mlp.experts.down_proj.scale")))

    def _shared_expert(self, reader: WeightReader, p: str) -> dict:
        """A shared expert's fields of library.Block: its gate/up and down, and its one-row gate."""
        if not self.config.shared_expert_ffn:
            raise NativeRefusal(f"the {self.spec.name} family has a shared expert, but the file gives it no width")
        gate_up_names, down_name, gate_name = self.spec.shared_expert_names(p)
        gate = reader.floats(gate_name)  # [1, hidden], or [hidden] as llama.cpp's quantizer leaves it
        if gate.size != self.hidden:
            raise ModelLoadError(f"{self.path}: {gate_name} has {gate.size} values, expected {self.hidden}")
        return dict(**self._mlp(reader, gate_up_names, down_name, field="shared_"),
                    shared_gate=library.Weight(self._address(gate.reshape(1, -1)), FLOAT_KERNEL_TYPES["F32"], 1))

    def _expert_biases(self, reader: WeightReader, p: str) -> dict:
        """The router's and the experts' biases, where the file has them: gate's and up's stacked per expert."""
        router, gate_up, down = self.spec.expert_names(p, "bias")
        out = {"router_bias": self._address(reader.bias([router]))}
        if any(reader.has(name) for name in gate_up):  # then all: a missing one is refused by name
            stacked = np.concatenate([reader.floats(name) for name in gate_up], axis=1)
            out["expert_gate_up_bias"] = self._address(stacked)
        if reader.has(down):
            out["expert_down_bias"] = self._address(reader.floats(down))
        return out

    def _address(self, array: np.ndarray | None) -> int | None:
        """Where a float32 copy of `array`, kept for the stack's life, lies (None for no array)."""
        if array is None:
            return None
        self._kept.append(np.ascontiguousarray(array, dtype=np.float32))
        return library.address(self._kept[-1])

    @property
    def family(self) -> str:
        return self.spec.name

    # -- sessions ----------------------------------------------------------------------------------------------
    def new_session(self, positions: int, limit: int | None = None) -> NativeSession:
        """A session with room for `positions` tokens (sliding-window blocks keep a ring of their window), growing
        as needed up to `limit` positions (default: none past `positions`)."""
        limit = positions if limit is None else limit
        if not 0 < positions <= limit <= self.context:
            raise ContextOverflowError(f"{max(positions, limit)} positions do not fit the context of {self.context}")
        session = NativeSession(capacity=positions, limit=limit)
        for shape in self._cache_shapes(positions):
            session.keys.append(np.zeros(shape, dtype=self.kv_dtype))
            session.values.append(np.zeros(shape, dtype=self.kv_dtype))
        return session

    def reserve(self, session: NativeSession, positions: int) -> None:
        """Room for `positions` tokens in the session's full caches: grown (at least doubled, copied) within its
        limit, or ContextOverflowError. A cache sized for the whole context up front would be mostly untouched, but
        transparent huge pages make the first write to each head's rows take 2 MiB."""
        if positions <= session.capacity:
            return
        if positions > session.limit:
            raise ContextOverflowError(f"{positions} positions do not fit the session's {session.limit}")
        grown = min(session.limit, max(positions, 2 * session.capacity))
        for caches in (session.keys, session.values):
            for index, (cache, block) in enumerate(zip(caches, self.blocks)):
                if not block.ring and not block.shared:
                    bigger = np.zeros((*cache.shape[:2], grown, cache.shape[3]), dtype=cache.dtype)
                    bigger[:, :, : session.capacity] = cache
                    caches[index] = bigger
        session.capacity = grown

    def _cache_shapes(self, positions: int) -> list[tuple[int, int, int, int]]:
        """Each block's key (and value) cache shape for a session of `positions`."""
        def row(head_dim: int) -> int:
            return head_dim // Q8_0_VALUES * Q8_0_BYTES if self.kv_code == 2 else head_dim

        def slots(block: BlockShape) -> int:
            return 0 if block.shared else block.slots if block.ring else positions

        return [(1, block.n_kv_heads, slots(block), row(block.head_dim)) for block in self.blocks]

    def reusable(self, session: NativeSession, ids: list[int]) -> int:
        """How many leading tokens of `ids` the session holds and can keep: their common prefix with its tokens, or 0
        where that cuts the session short after a sliding-window ring has wrapped (the ring then holds later
        positions in the slots the kept ones would need)."""
        common = 0
        for held, wanted in zip(session.tokens, ids):
            if held != wanted:
                break
            common += 1
        windows = [block.window for block in self.blocks if block.ring]
        if common < len(session.tokens) and windows and len(session.tokens) > min(windows):
            return 0
        return common

    def kv_bytes(self, positions: int) -> int:
        """Bytes of the key and value caches of a session of `positions`."""
        elements = sum(2 * int(np.prod(shape)) for shape in self._cache_shapes(positions))
        return elements * np.dtype(self.kv_dtype).itemsize

    # -- forward -----------------------------------------------------------------------------------------------
    def extend(self, session: NativeSession, ids: list[int], all_positions: bool = False) -> np.ndarray:
        """Run `ids` after the session's tokens: the last position's logits [vocab] (every position's, [T, vocab],
        with `all_positions`)."""
        if not ids:
            raise InvalidInputError("nothing to extend: no token ids")
        self._check(session, ids)
        start = len(session.tokens)
        outputs = []
        for first in range(0, len(ids), PREFILL_CHUNK):
            chunk = ids[first : first + PREFILL_CHUNK]
            last = first + PREFILL_CHUNK >= len(ids)
            h = self._blocks(np.asarray(chunk, dtype=np.int64), session, start + first)
            if all_positions:
                outputs.append(self._logits(h))
            elif last:
                outputs.append(self._logits(h[-1:])[0])
        session.tokens.extend(int(t) for t in ids)
        return np.concatenate(outputs) if all_positions else outputs[-1]

    def _embed(self, ids: np.ndarray) -> np.ndarray:
        h = self.embed.lookup(ids)
        return h * np.float32(self.embed_scale) if self.embed_scale is not None else h

    def _tables(self, positions: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """cos and signed sin [R, head_dim] per RoPE for the rows' positions (runlm.rope's blocks, grown as needed:
        the PyTorch backend's bits)."""
        needed = int(positions.max()) + 1
        cos, sin = [], []
        for index, (frequencies, scale) in enumerate(self.ropes):
            tables = self._rope_tables[index]
            while needed > len(tables[0]):
                more = table_block(frequencies, len(tables[0]), scale)
                tables = self._rope_tables[index] = (np.concatenate([tables[0], more[0]]),
                                                     np.concatenate([tables[1], more[1]]))
            cos.append(np.ascontiguousarray(tables[0][positions]))
            sin.append(np.ascontiguousarray(tables[1][positions]))
        return cos, sin

    def hidden_states(self, ids: list[int]) -> np.ndarray:
        """The final norm's output at every position of `ids` [T, hidden] on a throwaway session (what embeddings
        pool), in PREFILL_CHUNK pieces."""
        session = self.new_session(len(ids))
        self._check(session, ids)
        rows = [self._blocks(np.asarray(ids[first : first + PREFILL_CHUNK], dtype=np.int64), session, first)
                for first in range(0, len(ids), PREFILL_CHUNK)]
        return library.rms_norm(np.concatenate(rows), self.final_norm, self.final_eps)

    def extend_batch(self, sessions: list[NativeSession], ids_lists: list[list[int]],
                     every_row: list[bool] | None = None) -> list[np.ndarray]:
        """Each session's new tokens, all in one forward (every block reads its weights once for all the rows): the
        last new position's logits of each session, or every new position's [T, vocab] for a session marked in
        `every_row`. A row's logits do not depend on the rows beside it (the blocks and the head compute row by
        row), so they are what `extend` gives that session alone."""
        if len(sessions) != len(ids_lists) or not sessions or any(not ids for ids in ids_lists):
            raise InvalidInputError("extend_batch needs one non-empty token list per session")
        for session, ids in zip(sessions, ids_lists):
            self._check(session, ids)
        flat = [int(t) for ids in ids_lists for t in ids]
        row_seq = [index for index, ids in enumerate(ids_lists) for _ in ids]
        row_pos = [len(session.tokens) + j for session, ids in zip(sessions, ids_lists) for j in range(len(ids))]
        h = self._run(np.asarray(flat, dtype=np.int64), sessions, row_seq, row_pos)
        ends = np.cumsum([len(ids) for ids in ids_lists])
        for session, ids in zip(sessions, ids_lists):
            session.tokens.extend(int(t) for t in ids)
        if not every_row or not any(every_row):
            return list(self._logits(h[ends - 1]))
        spans = [(end - len(ids) if every else end - 1, end) for ids, end, every in zip(ids_lists, ends, every_row)]
        logits = self._logits(h[np.concatenate([np.arange(a, b) for a, b in spans])])
        bounds = np.cumsum([0] + [b - a for a, b in spans])
        return [logits[a] if not every else logits[a:b]
                for a, b, every in zip(bounds[:-1], bounds[1:], every_row)]

    def _check(self, session: NativeSession, ids: list[int]) -> None:
        if any(not 0 <= int(t) < self.vocab_size for t in ids):
            raise InvalidInputError(f"token ids must be in [0, {self.vocab_size})")
        self.reserve(session, len(session.tokens) + len(ids))

    def _blocks(self, ids: np.ndarray, session: NativeSession, start: int) -> np.ndarray:
        return self._run(ids, [session], [0] * len(ids), list(range(start, start + len(ids))))

    def _run(self, ids: np.ndarray, sessions: list[NativeSession], row_seq: list[int],
             row_pos: list[int]) -> np.ndarray:
        """The final hidden rows of `ids`, row i of sequence row_seq[i] at position row_pos[i] (one C call)."""
        h = np.ascontiguousarray(self._embed(ids), dtype=np.float32)
        per_layer = None if self.per_layer is None else self._per_layer_rows(ids, h)
        cos, sin = self._tables(np.asarray(row_pos, dtype=np.int64))
        caches = np.stack([s.cache_table() for s in sessions], axis=2)  # [3, blocks, sessions]
        library.check(library.library().rl_stack_run(
            self.stack, library.address(h), len(ids), library.pointers([library.address(c) for c in cos]),
            library.pointers([library.address(s) for s in sin]), len(cos), self._rope_widths_arg,
            library.address(caches[0]), library.address(caches[1]), library.address(caches[2]), self._rings_arg,
            len(sessions), self.kv_code, library.int64s(row_seq), library.int64s(row_pos),
            None if per_layer is None else library.address(per_layer),
        ))  # fmt: skip
        return h

    def _per_layer_rows(self, ids: np.ndarray, embedded: np.ndarray) -> np.ndarray:
        """Gemma 4's per-layer inputs of these rows [R, layers * width]: the tokens' own per-layer embedding (scaled
        by sqrt(width)) and the norm of a projection of their embedding (scaled by 1/sqrt(hidden)), averaged as
        transformers does (their sum over sqrt(2))."""
        own, projection, norm = self.per_layer
        width, f32 = self.config.per_layer_input, np.float32
        tokens = own.lookup(ids) * f32(width**0.5)
        projected = projection.multiply(embedded) * f32(self.hidden**-0.5)
        projected = library.rms_norm(projected.reshape(-1, width), norm, self.config.rms_eps).reshape(len(ids), -1)
        return np.ascontiguousarray((projected + tokens) * f32(2.0**-0.5), dtype=np.float32)

    def _logits(self, h: np.ndarray) -> np.ndarray:
        logits = self.head.multiply(library.rms_norm(h, self.final_norm, self.final_eps))
        if self.logit_scale is not None:
            logits /= np.float32(self.logit_scale)
        cap = self.final_softcap
        if cap is not None:  # in place: a prompt's logits over a 262k vocabulary are hundreds of MB
            np.divide(logits, np.float32(cap), out=logits)
            np.tanh(logits, out=logits)
            np.multiply(logits, np.float32(cap), out=logits)
        return logits


__all__ = ["KV_TYPES", "NativeModel", "NativeRefusal", "NativeSession", "PREFILL_CHUNK"]
