"""The decode loop without PyTorch: a lean image's blocks in one C call per forward, the KV caches as numpy arrays.

Each block runs in kernels.cpp's block_rows, the code the PyTorch path's fused blocks run, on the same RoPE tables
(runlm.rope), so a token's logits are that path's, bit for bit (tests/lean check it). Prompts go in chunks of
PREFILL_CHUNK rows, as on the PyTorch path.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runlm.errors import ContextOverflowError, InvalidInputError, ModelLoadError
from runlm.lean import native
from runlm.lean.image import Image, read
from runlm.quant.build import KERNEL_TYPES, Q8_0_BYTES, Q8_0_VALUES, X4_TYPES
from runlm.rope import table_block

PREFILL_CHUNK = 256
# KV cache element types: numpy dtype of a row element, and kernels.cpp's KvType
KV_TYPES = {"f16": (np.float16, 1), "f32": (np.float32, 0), "q8_0": (np.uint8, 2)}


@dataclass
class LeanSession:
    """One sequence: its tokens and, per block, its key and value caches ([1, n_kv, capacity, row])."""

    tokens: list[int] = field(default_factory=list)
    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    capacity: int = 0  # positions the full (non-ring) caches hold


class LeanModel:
    """A lean image ready to run: forward passes over sessions, logits out (float32 numpy)."""

    def __init__(self, image: Image, kv_type: str = "f16", threads: int | None = None):
        if kv_type not in KV_TYPES:
            raise InvalidInputError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        self.image, self.header = image, image.header
        lib = native.library()
        if threads:
            native.set_threads(threads)
        made_for = self.header["kernels"]["group_rows"]
        here = {name: native.group_rows(KERNEL_TYPES[name]) for name in X4_TYPES}
        if any(made_for.get(name) != rows for name, rows in here.items()):
            raise ModelLoadError(f"{image.path}: made for kernels of another build ({self.header['kernels']['isa']}); "
                                 f"this one is {native.isa()}: prepare the image again")
        self.kv_dtype, self.kv_code = KV_TYPES[kv_type]
        self.head_dim, self.hidden = self.header["head_dim"], self.header["hidden"]
        if kv_type == "q8_0" and self.head_dim % Q8_0_VALUES:
            raise InvalidInputError(f"kv_type q8_0 needs a head dim that is a multiple of 32, not {self.head_dim}")
        self.vocab_size, self.context = self.header["vocab_size"], self.header["context"]
        arrays = image.arrays
        self.stack = lib.rl_stack_new()
        weakref.finalize(self, lib.rl_stack_free, self.stack)
        for block in self.header["blocks"]:
            self._add_block(lib, block, arrays)
        self.inv_freqs = [arrays[name] for name in self.header["ropes"]]
        self._rope_tables = [(np.empty((0, self.head_dim), np.float32),) * 2 for _ in self.inv_freqs]
        self.final_norm = arrays[self.header["final_norm"]["tensor"]]
        self.final_eps = self.header["final_norm"]["eps"]

    @classmethod
    def open(cls, path: str | Path, kv_type: str = "f16", threads: int | None = None) -> LeanModel:
        return cls(read(Path(path)), kv_type, threads)

    def _add_block(self, lib, block: dict, arrays: dict[str, np.ndarray]) -> None:
        """One block onto the C stack (which copies the pointers; the image keeps what they point at)."""

        def parts(entries: list[dict]) -> tuple:
            return (native.pointers([native.address(arrays[e["tensor"]]) for e in entries]),
                    native.int64s([e["type"] for e in entries]), native.int64s([e["rows"] for e in entries]),
                    len(entries))  # fmt: skip

        norms = native.pointers([native.address(arrays[name]) for name in block["norms"]])
        optional = [native.address(arrays[block[k]]) if block[k] else None for k in ("q_norm", "k_norm")]
        o, down = block["o"], block["down"]
        native.check(lib.rl_stack_add_block(
            self.stack, norms, len(block["norms"]), self.hidden, block["eps"], *optional, *parts(block["qkv"]),
            native.address(arrays[o["tensor"]]), o["type"], *parts(block["gate_up"]),
            native.address(arrays[down["tensor"]]), down["type"], int(block["gelu"]), block["rope"], block["window"],
            block["n_heads"], block["n_kv_heads"], block["scale"],
        ))  # fmt: skip

    # -- sessions ----------------------------------------------------------------------------------------------
    def new_session(self, positions: int) -> LeanSession:
        """A session with room for `positions` tokens (sliding-window blocks keep a ring of their window)."""
        if not 0 < positions <= self.context:
            raise ContextOverflowError(f"{positions} positions do not fit the context of {self.context}")
        session = LeanSession(capacity=positions)
        for shape in self._cache_shapes(positions):
            session.keys.append(np.zeros(shape, dtype=self.kv_dtype))
            session.values.append(np.zeros(shape, dtype=self.kv_dtype))
        return session

    def _cache_shapes(self, positions: int) -> list[tuple[int, int, int, int]]:
        """Each block's key (and value) cache shape for a session of `positions`."""
        row = self.head_dim // Q8_0_VALUES * Q8_0_BYTES if self.kv_code == 2 else self.head_dim
        return [(1, block["n_kv_heads"], block["window"] if block["ring"] else positions, row)
                for block in self.header["blocks"]]

    def reusable(self, session: LeanSession, ids: list[int]) -> int:
        """How many leading tokens of `ids` the session holds and can keep: their common prefix with its tokens, or 0
        where that cuts the session short after a sliding-window ring has wrapped (the ring then holds later
        positions in the slots the kept ones would need)."""
        common = 0
        for held, wanted in zip(session.tokens, ids):
            if held != wanted:
                break
            common += 1
        windows = [block["window"] for block in self.header["blocks"] if block["ring"]]
        if common < len(session.tokens) and windows and len(session.tokens) > min(windows):
            return 0
        return common

    def kv_bytes(self, positions: int) -> int:
        """Bytes of the key and value caches of a session of `positions`."""
        elements = sum(2 * int(np.prod(shape)) for shape in self._cache_shapes(positions))
        return elements * np.dtype(self.kv_dtype).itemsize

    # -- forward -----------------------------------------------------------------------------------------------
    def extend(self, session: LeanSession, ids: list[int], all_positions: bool = False) -> np.ndarray:
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
        entry = self.header["embed"]
        table = self.image.arrays[entry["tensor"]]
        if entry["kind"] == "dense":
            h = np.ascontiguousarray(table[ids], dtype=np.float32)
        else:
            h = native.dequantize_rows(table, entry["type"], entry["rows"], self.hidden, ids)
        scale = self.header["embed_scale"]
        return h * np.float32(scale) if scale is not None else h

    def _tables(self, positions: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """cos and signed sin [R, head_dim] per RoPE for the rows' positions (runlm.rope's blocks, grown as needed:
        the PyTorch path's bits)."""
        needed = int(positions.max()) + 1
        cos, sin = [], []
        for index, inv_freq in enumerate(self.inv_freqs):
            tables = self._rope_tables[index]
            while needed > len(tables[0]):
                more = table_block(inv_freq, len(tables[0]))
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
        return native.rms_norm(np.concatenate(rows), self.final_norm, self.final_eps)

    def extend_batch(self, sessions: list[LeanSession], ids_lists: list[list[int]]) -> list[np.ndarray]:
        """Each session's new tokens, all in one forward (every block reads its weights once for all the rows): the
        last new position's logits of each session. A row's logits do not depend on the rows beside it (the blocks
        and the head compute row by row), so they are what `extend` gives that session alone."""
        if len(sessions) != len(ids_lists) or not sessions or any(not ids for ids in ids_lists):
            raise InvalidInputError("extend_batch needs one non-empty token list per session")
        for session, ids in zip(sessions, ids_lists):
            self._check(session, ids)
        flat = [int(t) for ids in ids_lists for t in ids]
        row_seq = [index for index, ids in enumerate(ids_lists) for _ in ids]
        row_pos = [len(session.tokens) + j for session, ids in zip(sessions, ids_lists) for j in range(len(ids))]
        h = self._run(np.asarray(flat, dtype=np.int64), sessions, row_seq, row_pos)
        logits = self._logits(h[np.cumsum([len(ids) for ids in ids_lists]) - 1])
        for session, ids in zip(sessions, ids_lists):
            session.tokens.extend(int(t) for t in ids)
        return list(logits)

    def _check(self, session: LeanSession, ids: list[int]) -> None:
        if any(not 0 <= int(t) < self.vocab_size for t in ids):
            raise InvalidInputError(f"token ids must be in [0, {self.vocab_size})")
        if len(session.tokens) + len(ids) > session.capacity:
            raise ContextOverflowError(f"{len(session.tokens) + len(ids)} positions do not fit the session's "
                                       f"{session.capacity}")

    def _blocks(self, ids: np.ndarray, session: LeanSession, start: int) -> np.ndarray:
        return self._run(ids, [session], [0] * len(ids), list(range(start, start + len(ids))))

    def _run(self, ids: np.ndarray, sessions: list[LeanSession], row_seq: list[int], row_pos: list[int]) -> np.ndarray:
        """The final hidden rows of `ids`, row i of sequence row_seq[i] at position row_pos[i] (one C call)."""
        h = np.ascontiguousarray(self._embed(ids), dtype=np.float32)
        cos, sin = self._tables(np.asarray(row_pos, dtype=np.int64))
        blocks = self.header["blocks"]
        per_block = range(len(blocks))
        native.check(native.library().rl_stack_run(
            self.stack, native.address(h), len(ids), native.pointers([native.address(c) for c in cos]),
            native.pointers([native.address(s) for s in sin]), len(cos), self.head_dim,
            native.pointers([native.address(s.keys[b]) for b in per_block for s in sessions]),
            native.pointers([native.address(s.values[b]) for b in per_block for s in sessions]),
            native.int64s([s.keys[b].shape[2] for b in per_block for s in sessions]),
            native.int64s([int(b["ring"]) for b in blocks]), len(sessions), self.kv_code, native.int64s(row_seq),
            native.int64s(row_pos),
        ))  # fmt: skip
        return h

    def _logits(self, h: np.ndarray) -> np.ndarray:
        normed = native.rms_norm(h, self.final_norm, self.final_eps)
        entry = self.header["head"]
        weight = self.image.arrays[entry["tensor"]]
        if entry["kind"] == "dense":
            logits = np.stack([weight @ row for row in normed]).astype(np.float32)  # row by row, as the torch path
        else:
            logits = native.linear(normed, weight, entry["type"], entry["rows"])
        cap = self.header["final_softcap"]
        if cap is not None:
            logits = (np.tanh(logits / np.float32(cap)) * np.float32(cap)).astype(np.float32)
        return logits


__all__ = ["KV_TYPES", "LeanModel", "LeanSession", "PREFILL_CHUNK"]
