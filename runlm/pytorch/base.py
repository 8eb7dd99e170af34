"""What every family shares: weight loading, the decoder stack, the cached runner."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from runlm.errors import InvalidInputError
from runlm.families.config import ModelConfig
from runlm.formats import WeightSource
from runlm.pytorch import kernels
from runlm.pytorch.dequant import dequantize
from runlm.pytorch.fused import Rows, fuse_blocks
from runlm.pytorch.int4 import DenseLinear, concat_linears, pack_linear
from runlm.pytorch.kernels import GGUFLinear
from runlm.pytorch.nn import FullKVCache, Rope, SlidingKVCache, kv_row_width
from runlm.runner import LmRunner, Session, SessionSnapshot, as_numpy

# Prompt tokens run at a time by `CachedRunner.extend`: the fused blocks' activations (~0.3 MB per token at 1B) stay
# bounded, and 256 rows keep the kernels' tiles full; the results do not depend on it (route invariance).
PREFILL_CHUNK = 256


class Embedding(nn.Module):
    """Token embeddings: a dense table, or GGUF blocks dequantized only for the rows looked up (read from the file's
    map, or from the tied LM head's blocks once `share_rows` gave it: one copy of the table, not two)."""

    def __init__(self, table: torch.Tensor | None = None, raw=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("table", table, persistent=False)
        self.raw, self.dtype = raw, dtype
        self.head: GGUFLinear | None = None

    def share_rows(self, head: GGUFLinear) -> None:
        """Look rows up in `head`, a GGUF linear of the same weight (the embedding tied to the LM head)."""
        self.head, self.raw = head, None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[ids]
        if self.head is not None:
            return self.head.gathered(ids).view(*ids.shape, -1).to(self.dtype)
        rows = self.raw.data[ids.cpu().numpy()]
        shape = (ids.numel(), self.raw.shape[1])
        if kernels.available() and self.raw.type_name in kernels.KERNEL_TYPES:
            return kernels.gguf_dequantize(torch.from_numpy(rows), self.raw.type_name, shape).to(self.dtype)
        return dequantize(self.raw.type_name, rows, shape).to(self.dtype)


class WeightLoader:
    """Turns named weights into modules: the float32 reference, or GGUF blocks kept as stored.

    Packed mode runs every GGUF type runlm's C++ kernels know on its blocks as they are, falls
    back to torch's int4 kernel for Q4_0 / Q4_1 / Q4_K when the kernels are not built, and
    dequantizes anything else once (float32: on CPUs without native bf16, dense bf16 is slower).
    """

    def __init__(self, source: WeightSource, dtype: torch.dtype = torch.float32, packed: bool = False):
        self.source, self.dtype, self.packed = source, dtype, packed
        self._dense: dict[str, torch.Tensor] = {}  # shared by a tied embedding and LM head
        self._quantized_embeddings: dict[str, Embedding] = {}  # a tied LM head built later serves their rows

    def norm_weight(self, name: str) -> torch.Tensor:
        return self.source.tensor(name)

    def _dense_weight(self, name: str) -> torch.Tensor:
        if name not in self._dense:
            self._dense[name] = self.source.tensor(name).to(self.dtype)
        return self._dense[name]

    def linear(self, names: Sequence[str]) -> nn.Module:
        """One linear module for weights stacked along the output dimension (fused QKV, gate/up).

        Packed mode prefers runlm's C++ kernels on the GGUF blocks themselves, then torch's
        int4 kernel, then a dequantized dense weight.
        """
        raws = [self.source.raw(name) if self.packed else None for name in names]
        if None not in raws:  # parts of one kernel type: one buffer, built without a second copy of any part
            module = kernels.gguf_linear_from_parts(raws)
            if module is not None:
                if len(names) == 1 and names[0] in self._quantized_embeddings:
                    self._quantized_embeddings[names[0]].share_rows(module)
                return module
        parts = []
        for name, raw in zip(names, raws):
            module = None
            if raw is not None:
                module = kernels.gguf_linear_from_parts([raw])
                if module is None:  # read, not through the map (see RawTensor)
                    module = pack_linear(raw.type_name, raw.read_rows(0, raw.shape[0]), raw.shape, torch.bfloat16)
            if module is None:
                module = DenseLinear(self._dense_weight(name))
            parts.append(module)
        return parts[0] if len(parts) == 1 else concat_linears(parts)

    def embedding(self, name: str) -> Embedding:
        """The token embedding; quantized tables stay in the file's map (only looked-up rows are read) until an LM
        head tied to them is built, whose blocks then serve the lookups."""
        raw = self.source.raw(name) if self.packed else None
        if raw is not None and raw.type_name not in ("F32", "F16", "BF16"):
            self._quantized_embeddings[name] = Embedding(raw=raw, dtype=self.dtype)
            return self._quantized_embeddings[name]
        return Embedding(table=self._dense_weight(name), dtype=self.dtype)


# -- the decoder stack --------------------------------------------------------------------


class DecoderLM(nn.Module):
    """Embedding, a stack of family blocks, final norm and LM head."""

    def __init__(
        self,
        config: ModelConfig,
        embed: Embedding,
        layers: Sequence[nn.Module],
        norm: nn.Module,
        head: nn.Module,
        ropes: Sequence[Rope],
        embed_scale: float | None = None,
    ):
        super().__init__()
        self.config = config
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm, self.head = norm, head
        self.ropes = nn.ModuleList(ropes)
        self.embed_scale = embed_scale
        self.fused_stack = False  # every block runs as one C++ call (set by models.fused)
        self.block_stack = None  # ... and all of them in one call (models.fused.FusedStack)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def new_cache(self, swa_full: bool = False, positions: int | None = None, dtype: torch.dtype | None = None) -> list:
        """One KV cache per layer: a ring of the window for sliding-window layers, unless `swa_full` keeps every
        position there too (more memory, but a prompt-cache snapshot can then be reused at any length). Full
        caches are sized for `positions` when the caller knows how many the session will hold. `dtype`: the
        caches' element type (default: the activations'; torch.uint8: q8_0 blocks, see nn.kv_row_width)."""
        cfg = self.config
        device = self.norm.scale.device
        dtype = dtype or self.dtype
        full = {} if positions is None else {"capacity": positions}
        return [
            SlidingKVCache(cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window, dtype, device)
            if cfg.is_sliding(i) and not swa_full
            else FullKVCache(cfg.num_kv_heads, cfg.head_dim, dtype, device, **full)
            for i in range(cfg.num_layers)
        ]

    def kv_bytes(self, positions: int, swa_full: bool = False, dtype: torch.dtype | None = None) -> int:
        """Bytes of the caches `new_cache(swa_full, positions, dtype)` makes (what a session of that many
        positions holds at most)."""
        cfg = self.config
        dtype = dtype or self.dtype
        per_position = 2 * cfg.num_kv_heads * kv_row_width(cfg.head_dim, dtype) * dtype.itemsize  # keys and values
        return sum(per_position * (cfg.sliding_window if cfg.is_sliding(i) and not swa_full else positions)
                   for i in range(cfg.num_layers))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def forward_embeds(
        self, h: torch.Tensor, cache: list, start: int, last_only: bool = True, image_group: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the stack on embeddings h [1, T, hidden] at positions start..start+T-1.

        `image_group` (multimodal prefill only): per absolute position, the image block
        it belongs to or -1; layers that take it make each block attend bidirectionally.
        """
        h = self._stack(h, cache, start, image_group)
        return self._logits(self.norm(h[:, -1:] if last_only else h))[0]

    def _stack(self, h: torch.Tensor, cache: list, start: int, image_group: torch.Tensor | None = None) -> torch.Tensor:
        """Every block over h [1, T, hidden] at positions start..start+T-1 (fused where it can be)."""
        t = h.shape[1]
        positions = torch.arange(start, start + t, device=h.device)
        tables = {id(rope): rope.tables(positions, h.dtype) for rope in self.ropes}
        if self.fused_stack and image_group is None:
            return self._fused_rows(h[0], [cache], [start], [t], tables)[None]
        extra = {} if image_group is None else {"image_group": image_group}
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, positions, tables, layer_cache, start, **extra)
        return h

    def _logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head (and the final soft cap where the model has one), in float32."""
        logits = self.head(normed).float()
        if self.config.logit_scale is not None:
            logits = logits / self.config.logit_scale
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    def hidden_states(self, ids: torch.Tensor, cache: list) -> torch.Tensor:
        """The final norm's output for ids [T] from position 0 on an empty cache: [T, hidden] (the stack as
        forward_embeds runs it, without the LM head: embeddings pool these rows)."""
        return self.norm(self._stack(self.embed_tokens(ids)[None], cache, 0))[0]

    def forward(self, ids: torch.Tensor, cache: list, start: int, last_only: bool = True) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(ids)[None], cache, start, last_only)

    def forward_rows(self, ids: torch.Tensor, caches: list[list], starts: list[int], counts: list[int]) -> torch.Tensor:
        """Ragged rows through fused blocks: counts[i] new tokens of sequence i from position starts[i], all in
        one call per block; the logits of each sequence's last new row [B, vocab]."""
        h = self.embed_tokens(ids)
        positions = torch.tensor([s + j for s, c in zip(starts, counts) for j in range(c)], device=h.device)
        tables = {id(rope): rope.tables(positions, h.dtype) for rope in self.ropes}
        h = self._fused_rows(h, caches, starts, counts, tables)
        last = torch.tensor(counts, device=h.device).cumsum(0) - 1
        return self._logits(self.norm(h[last]))

    def _fused_rows(self, h: torch.Tensor, caches: list[list], starts: list[int], counts: list[int],
                    tables: dict) -> torch.Tensor:
        """h [R, hidden] through every block as one C++ call each (fused_stack)."""
        rows = Rows(starts, counts, tables)
        if self.block_stack is not None:
            return self.block_stack.run(h, rows, caches)
        for index, layer in enumerate(self.layers):
            h = layer.fused.run(h, rows, [cache[index] for cache in caches])
        return h

    def forward_batch(self, ids: torch.Tensor, caches: list[list], starts: list[int]) -> torch.Tensor:
        """One decode step for B sequences, each with its own cache and position: logits [B, vocab].

        The projections and the MLP run once for the whole batch (weights are read once per
        step, which is where batching pays); attention runs per sequence over its own cache.
        """
        h = self.embed_tokens(ids)[:, None]
        positions = torch.tensor(starts, device=h.device)[:, None]
        tables = {id(rope): rope.tables(positions, h.dtype) for rope in self.ropes}
        for index, layer in enumerate(self.layers):
            h = layer.forward_batch(h, positions, tables, [cache[index] for cache in caches], starts)
        return self._logits(self.norm(h[:, -1]))


# -- the runner --------------------------------------------------------------------------


class CachedRunner(LmRunner):
    """The runner contract over a DecoderLM: sessions hold per-layer KV caches, decode is cached,
    and several sessions decode together in one batched forward."""

    def __init__(self, model: DecoderLM, family: str, max_context: int | None = None, swa_full: bool = False):
        self.model, self.family_name = model, family
        self.context = max_context or model.config.max_position
        self.swa_full = swa_full  # sliding-window layers keep every position (see DecoderLM.new_cache)
        # The KV caches' element type for sessions made from now on: the activations' unless set (runlm.load sets
        # float16 on the packed path; the kernels and torch's attention read it back as float32).
        self.kv_dtype: torch.dtype = model.dtype
        self.fused_blocks = fuse_blocks(model, model.dtype, self.device)

    @property
    def device(self) -> torch.device:
        return self.model.norm.scale.device

    def to_device(self, device: torch.device) -> None:
        """Move the weights to `device`; sessions made before the move are not valid after it."""
        if self.kv_dtype == torch.uint8 and torch.device(device).type != "cpu":  # q8_0: see loading.KV_TYPES
            raise InvalidInputError(f"a q8_0 KV cache is read by runlm's CPU kernels only: it cannot move to {device}")
        self.model.to(device)
        self.fused_blocks = fuse_blocks(self.model, self.model.dtype, self.device)
        self.__dict__.pop("_own_session", None)

    # -- the contract ------------------------------------------------------------------
    def family(self) -> str:
        return self.family_name

    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def max_context(self) -> int:
        return self.context

    def predict_logits(self, prompt_ids: Sequence[int]) -> np.ndarray:
        return self.prefill(self.new_session(), prompt_ids)

    def new_session(self, positions: int | None = None) -> Session:
        return Session(state=self.model.new_cache(self.swa_full, positions, self.kv_dtype))

    def kv_bytes(self, positions: int) -> int | None:
        return self.model.kv_bytes(positions, self.swa_full, self.kv_dtype)

    def reset_session(self, session: Session) -> None:
        for layer_cache in session.state:
            layer_cache.reset()
        session.tokens = []

    @torch.inference_mode()
    def extend(self, session: Session, ids: Sequence[int], all_positions: bool = False) -> np.ndarray:
        if len(ids) == 0:
            raise InvalidInputError("nothing to extend: no token ids")
        self.check_tokens(ids)
        start = len(session.tokens)
        self.check_fits(start + len(ids))
        ids_tensor = torch.tensor([int(t) for t in ids], dtype=torch.long, device=self.device)
        while not all_positions and len(ids_tensor) > PREFILL_CHUNK:  # a long prompt one chunk's memory at a time
            self.model(ids_tensor[:PREFILL_CHUNK], session.state, start)
            ids_tensor, start = ids_tensor[PREFILL_CHUNK:], start + PREFILL_CHUNK
        logits = as_numpy(self.model(ids_tensor, session.state, start, last_only=not all_positions))
        session.tokens.extend(int(t) for t in ids)
        return logits if all_positions else logits[-1]

    @torch.inference_mode()
    def hidden_states(self, ids: Sequence[int]) -> np.ndarray:
        """One forward over a throwaway cache (no session is touched): [T, hidden] float32 on the CPU."""
        self.check_prompt(ids)
        self.check_fits(len(ids))
        ids_tensor = torch.tensor([int(t) for t in ids], dtype=torch.long, device=self.device)
        return as_numpy(self.model.hidden_states(ids_tensor, self.model.new_cache(dtype=self.kv_dtype)))

    @torch.inference_mode()
    def extend_batch(self, sessions: Sequence[Session], ids_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """One batched forward: projections and MLP read the weights once for every row of every session.

        Fused blocks take ragged rows (a prefill chunk beside decode steps); the float32 reference path
        batches one token per session and extends sessions one by one otherwise.
        """
        self.check_batch(sessions, ids_lists)
        if len(sessions) == 1:
            return [self.extend(sessions[0], ids_lists[0])]
        counts = [len(ids) for ids in ids_lists]
        starts = [len(session.tokens) for session in sessions]
        caches = [session.state for session in sessions]
        flat = torch.tensor([int(t) for ids in ids_lists for t in ids], dtype=torch.long, device=self.device)
        if self.model.fused_stack:
            logits = as_numpy(self.model.forward_rows(flat, caches, starts, counts))
        elif all(count == 1 for count in counts):
            logits = as_numpy(self.model.forward_batch(flat, caches, starts))
        else:
            return super().extend_batch(sessions, ids_lists)
        for session, ids in zip(sessions, ids_lists):
            session.tokens.extend(int(t) for t in ids)
        return list(logits)

    @torch.inference_mode()
    def export(self, session: Session) -> SessionSnapshot | None:
        states = [layer_cache.snapshot() for layer_cache in session.state]
        nbytes = sum(t.numel() * t.element_size() for state in states for t in state)
        return SessionSnapshot(token_ids=list(session.tokens), cache=states, nbytes=nbytes, family=self.family())

    @torch.inference_mode()
    def restore(self, session: Session, snap: SessionSnapshot, length: int | None = None) -> bool:
        length = len(snap.token_ids) if length is None else length
        if snap.family != self.family() or len(snap.cache) != len(session.state) or length > len(snap.token_ids):
            return False
        self.reset_session(session)
        if not all(c.restore(state, length) for c, state in zip(session.state, snap.cache)):
            self.reset_session(session)
            return False
        session.tokens = list(snap.token_ids[:length])
        return True
