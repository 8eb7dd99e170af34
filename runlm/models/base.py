"""What every family shares: config, weight loading, the decoder stack, the cached runner."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runlm.errors import ContextOverflowError, InvalidInputError, ModelLoadError
from runlm.nn import FullKVCache, Rope, SlidingKVCache
from runlm.runner import LmRunner, OnToken, SessionSnapshot, check_n_new, check_token


@dataclass
class ModelConfig:
    """Architecture numbers, read from config.json or GGUF metadata by each family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_position: int
    rope_scaling: dict | None = None
    tie_embeddings: bool = True
    # Gemma-style extras; families that do not use them leave the defaults.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None
    local_rope_scaling: dict | None = None
    query_pre_attn_scalar: float | None = None
    final_softcap: float | None = None
    attn_softcap: float | None = None

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"


def hf_rope(config: dict, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(theta, scaling) from a config.json in either the transformers 4 or 5 layout."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        return float(params["rope_theta"]), scaling
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(config.get("rope_theta", 10000.0)), scaling


# -- weight sources -------------------------------------------------------------------


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


class GGUFSource(WeightSource):
    """A GGUF file read through a family's HF-name -> GGUF-name mapping."""

    def __init__(self, gguf, rename: Callable[[str], str], row_perm: Callable[[str], torch.Tensor | None]):
        self.gguf, self.rename, self.row_perm, self.path = gguf, rename, row_perm, gguf.path

    def has(self, name: str) -> bool:
        return self.gguf.has(self.rename(name))

    def raw(self, name: str):
        from runlm.formats.gguf import RawTensor

        raw = self.gguf.raw(self.rename(name))
        perm = self.row_perm(name)
        if perm is None:
            return raw
        return RawTensor(raw.name, raw.type_name, raw.shape, raw.data.reshape(raw.shape[0], -1)[perm.numpy()])

    def tensor(self, name: str) -> torch.Tensor:
        from runlm.quant import dequantize

        raw = self.raw(name)
        try:
            return dequantize(raw.type_name, raw.data, raw.shape)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path}: tensor {raw.name!r}: {exc}") from exc


class SafetensorsSource(WeightSource):
    """A Hugging Face directory's safetensors shards (index or single file)."""

    def __init__(self, directory, prefix_candidates: Sequence[tuple[str, str]] = (("", ""),)):
        import json

        from safetensors import safe_open

        self.path = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"{directory}: no *.safetensors files")
        self._where: dict[str, Any] = {}
        for filename in files:
            if not (directory / filename).is_file():
                raise ModelLoadError(f"{directory}: shard {filename} listed in the index is missing")
            try:
                handle = safe_open(str(directory / filename), framework="pt")
            except Exception as exc:
                raise ModelLoadError(f"{directory / filename}: corrupt safetensors file ({exc})") from exc
            for key in handle.keys():
                self._where[key] = handle
        # (strip, add) turns a text-model name into this checkpoint's name (multimodal checkpoints nest it).
        self.prefix = next(
            (p for p in prefix_candidates if self._apply("model.embed_tokens.weight", p) in self._where), ("", "")
        )

    @staticmethod
    def _apply(name: str, prefix: tuple[str, str]) -> str:
        strip, add = prefix
        return add + name[len(strip) :] if name.startswith(strip) else name

    def _key(self, name: str) -> str:
        key = self._apply(name, self.prefix)
        return name if key not in self._where and name in self._where else key

    def has(self, name: str) -> bool:
        return self._key(name) in self._where

    def tensor(self, name: str) -> torch.Tensor:
        key = self._key(name)
        if key not in self._where:
            raise ModelLoadError(f"{self.path}: missing tensor {key!r}")
        return self._where[key].get_tensor(key).float()


class Embedding(nn.Module):
    """Token embeddings: a dense table, or GGUF blocks dequantized only for the rows looked up."""

    def __init__(self, table: torch.Tensor | None = None, raw=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.register_buffer("table", table, persistent=False)
        self.raw, self.dtype = raw, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table[ids]
        from runlm.quant import kernels

        rows = self.raw.data[ids.cpu().numpy()]
        shape = (ids.numel(), self.raw.shape[1])
        if kernels.available() and self.raw.type_name in kernels.KERNEL_TYPES:
            return kernels.gguf_dequantize(torch.from_numpy(rows), self.raw.type_name, shape).to(self.dtype)
        from runlm.quant import dequantize

        return dequantize(self.raw.type_name, rows, shape).to(self.dtype)


class WeightLoader:
    """Turns named weights into modules: float32 reference, or int4-packed where GGUF allows it.

    Packed mode keeps Q4_0 / Q4_1 / Q4_K linears as int4 (bf16 activations inside the
    kernel, the only dtype it vectorizes) and dequantizes every other type once, to
    float32: on CPUs without native bf16, dense bf16 matmuls are slower than float32.
    """

    def __init__(self, source: WeightSource, dtype: torch.dtype = torch.float32, packed: bool = False):
        self.source, self.dtype, self.packed = source, dtype, packed
        self._dense: dict[str, torch.Tensor] = {}  # shared by a tied embedding and LM head

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
        from runlm.quant.kernels import gguf_linear_module
        from runlm.quant.packed import DenseLinear, concat_linears, pack_linear

        parts = []
        for name in names:
            module = None
            raw = self.source.raw(name) if self.packed else None
            if raw is not None:
                module = gguf_linear_module(raw.type_name, raw.data, raw.shape)
                if module is None:
                    module = pack_linear(raw.type_name, raw.data, raw.shape, torch.bfloat16)
            if module is None:
                module = DenseLinear(self._dense_weight(name))
            parts.append(module)
        return parts[0] if len(parts) == 1 else concat_linears(parts)

    def embedding(self, name: str) -> Embedding:
        raw = self.source.raw(name) if self.packed else None
        if raw is not None and raw.type_name not in ("F32", "F16", "BF16"):
            return Embedding(raw=raw, dtype=self.dtype)
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

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def new_cache(self) -> list:
        cfg = self.config
        device = self.norm.scale.device
        return [
            SlidingKVCache(cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window, self.dtype, device)
            if cfg.is_sliding(i)
            else FullKVCache(cfg.num_kv_heads, cfg.head_dim, self.dtype, device)
            for i in range(cfg.num_layers)
        ]

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
        t = h.shape[1]
        positions = torch.arange(start, start + t, device=h.device)
        tables = {id(rope): rope.tables(positions, h.dtype) for rope in self.ropes}
        extra = {} if image_group is None else {"image_group": image_group}
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, positions, tables, layer_cache, start, **extra)
        if last_only:
            h = h[:, -1:]
        logits = self.head(self.norm(h)).float()
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits[0]

    def forward(self, ids: torch.Tensor, cache: list, start: int, last_only: bool = True) -> torch.Tensor:
        return self.forward_embeds(self.embed_tokens(ids)[None], cache, start, last_only)

    def forward_batch(self, ids: torch.Tensor, caches: list[list], starts: list[int]) -> torch.Tensor:
        """One decode step for B sequences, each with its own cache and position: logits [B, vocab].

        The projections and the MLP run once for the whole batch (weights are read once per
        step, which is where batching pays); attention runs per sequence over its own cache.
        """
        h = self.embed_tokens(ids)[:, None]
        positions = torch.tensor(starts, device=h.device)[:, None]
        tables = {id(rope): rope.tables(positions, h.dtype) for rope in self.ropes}
        for index, layer in enumerate(self.layers):
            h = layer(h, positions, tables, [cache[index] for cache in caches], starts)
        logits = self.head(self.norm(h[:, -1])).float()
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits


# -- the runner --------------------------------------------------------------------------


@dataclass
class Session:
    """One sequence's decode state: its per-layer KV caches and the tokens they hold."""

    cache: list
    tokens: list[int] = field(default_factory=list)


class CachedRunner(LmRunner):
    """The runner contract over a DecoderLM: cached decode, host-driven decode, sessions.

    The contract's calls act on the current `session`; a batcher keeps several sessions
    and swaps them in with `use_session`, or steps them together with `decode_batch`.
    """

    family_name = ""

    def __init__(self, model: DecoderLM, max_context: int | None = None):
        self.model = model
        self.max_context = max_context or model.config.max_position
        self.session = self.new_session()

    @property
    def cache(self) -> list:
        return self.session.cache

    @property
    def device(self) -> torch.device:
        return self.model.norm.scale.device

    def to_device(self, device: torch.device) -> None:
        """Move the weights (and any vision tower) to `device`; sessions start over there."""
        self.model.to(device)
        if getattr(self, "vision", None) is not None:
            self.vision.to(device)
        self.session = self.new_session()

    @property
    def tokens(self) -> list[int]:
        return self.session.tokens

    def new_session(self) -> Session:
        return Session(self.model.new_cache())

    def use_session(self, session: Session) -> None:
        """Make `session` the one prefill / decode / export act on."""
        self.session = session

    @torch.inference_mode()
    def decode_batch(self, sessions: Sequence[Session], tokens: Sequence[int]) -> torch.Tensor:
        """Feed one token to each session in one batched forward; logits [B, vocab]."""
        if len(sessions) != len(tokens) or not sessions:
            raise InvalidInputError("decode_batch needs one token per session, and at least one session")
        vocab = self.vocab_size()
        for session, token in zip(sessions, tokens):
            if not session.tokens:
                raise InvalidInputError("decode_batch needs prefilled sessions")
            check_token(token, vocab)
            self._check_fits(len(session.tokens) + 1)
        if len(sessions) == 1:  # the single-sequence decode path
            self.use_session(sessions[0])
            return self._extend([int(tokens[0])])[None]
        starts = [len(session.tokens) for session in sessions]
        ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.device)
        logits = self.model.forward_batch(ids, [session.cache for session in sessions], starts).cpu()
        for session, token in zip(sessions, tokens):
            session.tokens.append(int(token))
        return logits

    def family(self) -> str:
        return self.family_name

    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # -- internals -------------------------------------------------------------
    def _check_fits(self, total: int) -> None:
        if total > self.max_context:
            raise ContextOverflowError(f"{total} tokens do not fit the context of {self.max_context} tokens")

    @torch.inference_mode()
    def _extend(self, ids: Sequence[int], all_positions: bool = False) -> torch.Tensor:
        """Append tokens to the current session; logits of the last position (or of every one)."""
        start = len(self.tokens)
        self._check_fits(start + len(ids))
        ids_tensor = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        logits = self.model(ids_tensor, self.cache, start, last_only=not all_positions).cpu()
        self.session.tokens.extend(int(t) for t in ids)
        return logits if all_positions else logits[-1]

    # -- beyond the contract: scoring (perplexity, prompt log-probs) ---------------
    def extend_all(self, ids: Sequence[int]) -> torch.Tensor:
        """Append tokens to the session and return logits for every new position [T, vocab]."""
        if len(ids) == 0:
            raise InvalidInputError("nothing to extend: no token ids")
        vocab = self.vocab_size()
        for token in ids:
            check_token(token, vocab)
        return self._extend(ids, all_positions=True)

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget the session: the next extend starts at position 0."""
        for layer_cache in self.cache:
            layer_cache.length = 0
            if isinstance(layer_cache, SlidingKVCache):
                layer_cache.pos.fill_(-1)
        self.session.tokens = []

    # -- the contract ------------------------------------------------------------
    def predict_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        return self.prefill_logits(prompt_ids)

    def prefill_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        self.check_prompt(prompt_ids)
        self.reset()
        return self._extend(prompt_ids)

    def decode_logits(self, token: int) -> torch.Tensor:
        if not self.tokens:
            raise InvalidInputError("decode_logits needs a prefilled session: call prefill_logits first")
        check_token(token, self.vocab_size())
        return self._extend([token])

    def generate(self, prompt_ids: Sequence[int], n_new: int, on_token: OnToken | None = None) -> list[int]:
        check_n_new(n_new)
        self.check_prompt(prompt_ids)
        self._check_fits(len(prompt_ids) + n_new)
        if n_new == 0:
            return []
        return self.greedy_continue(self.prefill_logits(prompt_ids), n_new, on_token)

    def greedy_continue(self, logits: torch.Tensor, n_new: int, on_token: OnToken | None) -> list[int]:
        """Greedy tokens from the prefilled session's `logits` on, on the cached decode path."""
        produced: list[int] = []
        while True:
            token = int(torch.argmax(logits))
            produced.append(token)
            if on_token is not None and not on_token(token):
                return produced
            if len(produced) >= n_new:
                return produced
            logits = self.decode_logits(token)

    @torch.inference_mode()
    def export_session(self) -> SessionSnapshot | None:
        states = [layer_cache.snapshot() for layer_cache in self.cache]
        nbytes = sum(t.numel() * t.element_size() for state in states for t in state)
        return SessionSnapshot(token_ids=list(self.tokens), cache=states, nbytes=nbytes, family=self.family())

    def restore_session(self, snap: SessionSnapshot) -> bool:
        return self._restore(snap, len(snap.token_ids))

    @torch.inference_mode()
    def _restore(self, snap: SessionSnapshot, length: int) -> bool:
        if snap.family != self.family() or len(snap.cache) != len(self.cache):
            return False
        if length > len(snap.token_ids):
            return False
        self.reset()
        if not all(c.restore(state, length) for c, state in zip(self.cache, snap.cache)):
            self.reset()
            return False
        self.session.tokens = list(snap.token_ids[:length])
        return True

    def prefill_logits_reusing(self, prompt: Sequence[int], snap: SessionSnapshot, reuse_len: int) -> torch.Tensor:
        self.check_prompt(prompt)
        if not 0 <= reuse_len <= len(snap.token_ids):
            raise InvalidInputError(f"reuse_len {reuse_len} is outside the snapshot's {len(snap.token_ids)} tokens")
        if list(prompt[:reuse_len]) != snap.token_ids[:reuse_len]:
            raise InvalidInputError("the prompt does not start with the snapshot's first reuse_len tokens")
        # At least one token must run to produce logits for the last position.
        reuse = min(reuse_len, len(prompt) - 1)
        if reuse == 0 or not self._restore(snap, reuse):
            return self.prefill_logits(prompt)
        return self._extend(prompt[reuse:])


def default_attention_scale(config: ModelConfig) -> float:
    return 1.0 / math.sqrt(config.query_pre_attn_scalar or config.head_dim)


# -- GGUF naming ---------------------------------------------------------------------------

_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str, overrides: dict[str, str] | None = None) -> str:
    """llama.cpp's tensor name for a transformers parameter name; unknown names pass through."""
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")
    if len(parts) >= 5 and parts[0] == "model" and parts[1] == "layers":
        module = ".".join(parts[3:-1])
        table = {**_GGUF_LAYER_NAMES, **(overrides or {})}
        if module in table:
            return f"blk.{parts[2]}.{table[module]}.{parts[-1]}"
    return hf_name


def gguf_int(gguf, key: str, default: int | None = None) -> int:
    value = gguf.arch_value(key, default)
    if value is None:
        raise ModelLoadError(f"{gguf.path}: GGUF metadata lacks {gguf.architecture}.{key}")
    return int(value)


def gguf_common_config(gguf) -> dict[str, Any]:
    """The ModelConfig fields every llama.cpp architecture writes the same way."""
    heads = gguf_int(gguf, "attention.head_count")
    hidden = gguf_int(gguf, "embedding_length")
    vocab = gguf.arch_value("vocab_size") or len(gguf.metadata.get("tokenizer.ggml.tokens", []))
    if not vocab:
        raise ModelLoadError(f"{gguf.path}: cannot tell the vocabulary size")
    scaling = None
    if gguf.arch_value("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(gguf.arch_value("rope.scaling.factor"))}
    return dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=gguf_int(gguf, "feed_forward_length"),
        num_layers=gguf_int(gguf, "block_count"),
        num_heads=heads,
        num_kv_heads=gguf_int(gguf, "attention.head_count_kv", heads),
        head_dim=gguf_int(gguf, "attention.key_length", hidden // heads),
        rms_eps=float(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf.arch_value("rope.freq_base", 10000.0)),
        max_position=gguf_int(gguf, "context_length", 4096),
        rope_scaling=scaling,
        tie_embeddings=not gguf.has("output.weight"),
    )


def hf_common_config(cfg: dict) -> dict[str, Any]:
    """The ModelConfig fields config.json spells the same way across families."""
    try:
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        theta, scaling = hf_rope(cfg)
        return dict(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            rope_scaling=scaling,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r}") from exc
