"""Tokenizers for GGUF files and Hugging Face directories, built on the `tokenizers` library.

A GGUF carries no `tokenizer.json`, only llama.cpp's description of one (vocabulary, merges or
scores, token types, pre-tokenizer name). We rebuild the same pipeline transformers' GGUF converter
builds, so ids match the reference tokenizer of the model family.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from runlm.catalog import runlm_home
from runlm.errors import RunlmError, TokenizerError
from runlm.formats.gguf import GGUFFile
from runlm.system import collection_paused
from runlm.text.bpe import BpeEncoder, outside_byte_alphabet, spelled_bytes, vocabulary_spelling
from runlm.text.fim import FIM_ROLES, FimTokens, fim_tokens, find_fim_ids
from runlm.text.spm import PREFIX_EACH_PIECE, PREFIX_FIRST_PIECE, PREFIX_NONE, SpmEncoder

log = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Token texts that end a turn when they are special tokens (llama.cpp's end-of-generation list).
EOG_TOKEN_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<|return|>",
    "<|call|>",
    "<turn|>",  # Gemma 4's end of turn
    "<|tool_response>",  # Gemma 4 after its tool calls: the results are the caller's to write
)

_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# ---------------------------------------------------------------------------------------------
# Byte-level BPE pre-tokenizers, by `tokenizer.ggml.pre` (names and groups as llama.cpp reads them,
# regexes as the families' own tokenizer.json files write them).

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

_GPT2 = "gpt2"  # ByteLevel's own GPT-2 regex, _GPT2_SPLIT
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_DIGITS = "digits"  # every digit alone, then the GPT-2 regex (StarCoder-style vocabularies)


class _Pre:
    """How one `tokenizer.ggml.pre` splits text, and the defaults llama.cpp attaches to it."""

    def __init__(self, splits: str | tuple[str, ...], *, ignore_merges: bool = False, add_bos: bool = False):
        self.splits = splits
        self.ignore_merges = ignore_merges
        self.add_bos = add_bos

    def patterns(self) -> tuple[str, ...]:
        """The split regexes, each applied to every piece the ones before it cut (the native encoder's steps)."""
        if self.splits == _GPT2:
            return (_GPT2_SPLIT,)
        if self.splits == _DIGITS:
            return (r"\p{N}", _GPT2_SPLIT)  # Digits(individual_digits): each number character alone
        return (self.splits,) if isinstance(self.splits, str) else self.splits

    def build(self) -> pre_tokenizers.PreTokenizer:
        if self.splits == _GPT2:
            return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.splits == _DIGITS:
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        splits = (self.splits,) if isinstance(self.splits, str) else self.splits
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )


def _group(names: str, pre: _Pre) -> dict[str, _Pre]:
    return dict.fromkeys(names.split(), pre)


BPE_PRE_TYPES: dict[str, _Pre] = {
    **_group(
        "default gpt-2 gpt2 phi-2 mpt olmo jais gigachat exaone4 a.x-4.0 mellum trillion granite-docling "
        "jina-es jina-de jina-v2-es jina-v2-de",
        _Pre(_GPT2),
    ),
    **_group("starcoder refact smollm codeshell command-r exaone minerva-7b", _Pre(_DIGITS)),
    **_group(
        "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
        _Pre(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True),
    ),
    **_group("dbrx smaug-bpe glm4 chatglm-bpe", _Pre(_LLAMA3_SPLIT)),
    **_group("qwen2 qwen2.5 qwen-2.5 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan", _Pre(_QWEN2_SPLIT)),
    "qwen35": _Pre(_QWEN35_SPLIT),
    "tekken": _Pre(_TEKKEN_SPLIT, ignore_merges=True, add_bos=True),
    **_group("gpt-4o llama4 kanana2 talkie minimax-m2", _Pre(_GPT4O_SPLIT)),
    "deepseek-v3": _Pre(_DEEPSEEK3_SPLITS),
}


def _split_merge(merge: str, start: int = 0) -> tuple[str, str]:
    """'a b' -> ('a', 'b'), cutting at the first space from `start` (byte-level BPE: a token may be a space)."""
    cut = merge.find(" ", start)
    if cut < 0:
        raise TokenizerError(f"malformed merge {_short(merge)} in tokenizer.ggml.merges (expected 'left right')")
    return merge[:cut], merge[cut + 1 :]


def _generate_merges(vocab: Mapping[str, int], ranking: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a merge-less vocabulary implies: every split of a token into two known tokens,
    best-ranked result first (transformers' `generate_merges`, so ties break the same way).

    Only split points where both halves have the length of some token are tried, so a piece costs at most
    min(its length, the number of distinct token lengths) set lookups plus the slices of real candidates: a
    forged 2 MB token costs a few lookups instead of 2M slices of up to 2 MB each (quadratic, a hang).
    """
    lengths = sorted({len(token) for token in vocab if token})
    known_lengths = set(lengths)
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, score in ranking.items():
        n = len(piece)
        if n < 2:
            continue
        cuts = range(1, n) if n <= len(lengths) else lengths[: bisect.bisect_left(lengths, n)]
        local = [
            (piece[:i], piece[i:])
            for i in cuts
            if i in known_lengths and n - i in known_lengths and piece[:i] in vocab and piece[i:] in vocab
        ]
        if len(local) > 1:
            local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend((score, len(a), len(b), a, b) for a, b in local)
    # A stable sort on the key alone (not the strings), so equal keys keep the order built above.
    merges.sort(key=lambda m: m[:3], reverse=True)
    return [(m[3], m[4]) for m in merges]


# tokenizer.ggml.* keys -> (the Python type a value or each list item must have, whether it is a list)
_GGUF_TOKENIZER_TYPES: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "tokens": (str, True),
    "token_type": (int, True),
    "merges": (str, True),
    "scores": ((int, float), True),
    "model": (str, False),
    "pre": (str, False),
}


def _check_gguf_tokenizer_types(metadata: Mapping[str, Any]) -> None:
    """Refuse tokenizer metadata of the wrong type (a number array where strings belong, a list as `pre`),
    naming the key, instead of failing somewhere inside the build."""
    for name, (kind, is_list) in _GGUF_TOKENIZER_TYPES.items():
        key = f"tokenizer.ggml.{name}"
        value = metadata.get(key)
        if value is None:
            continue
        what = kind.__name__ if isinstance(kind, type) else "number"
        if is_list and not isinstance(value, list):
            raise TokenizerError(f"GGUF metadata {key} is {_short(value)}, expected an array of {what}")
        if not is_list and not isinstance(value, kind):
            raise TokenizerError(f"GGUF metadata {key} is {_short(value)}, expected a {what}")
        allowed = set(kind) if isinstance(kind, tuple) else {kind}  # exact types: a bool is not a number here
        if is_list and not set(map(type, value)) <= allowed:
            raise TokenizerError(f"GGUF metadata {key} holds items that are not {what}s")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _spm_style(metadata: Mapping[str, Any]) -> tuple[bool, bool]:
    """(gemma, add_prefix): Gemma's normalizer instead of Metaspace, and whether text gets a leading ▁."""
    gemma = metadata.get("general.architecture") in _GEMMA_ARCHS
    return gemma, bool(metadata.get("tokenizer.ggml.add_space_prefix", not gemma))


def _spm_pieces(metadata: Mapping[str, Any], tokens: list[str]) -> list[str]:
    """A SentencePiece vocabulary's pieces as the model looks them up: Gemma stores its runs of spaces as real spaces,
    and its model spells them with ▁."""
    if not _spm_style(metadata)[0]:
        return tokens
    return ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]


def _spm_ranking(metadata: Mapping[str, Any], count: int) -> np.ndarray:
    """The ranking of the merge that makes each of a SentencePiece vocabulary's `count` pieces (higher merges first):
    its scores, or the file's order where the file is Gemma's (its scores put its added tokens last) or has no scores
    for every piece."""
    gemma, _ = _spm_style(metadata)
    scores = metadata.get("tokenizer.ggml.scores")
    if gemma or not isinstance(scores, list) or len(scores) != count:
        return -np.arange(count, dtype=np.float64)
    return np.asarray(scores, dtype=np.float64)


def _bpe_pre(metadata: Mapping[str, Any]) -> _Pre:
    """How a byte-level vocabulary splits text, by its `tokenizer.ggml.pre`."""
    pre_name = metadata.get("tokenizer.ggml.pre") or "default"
    pre = BPE_PRE_TYPES.get(pre_name)
    if pre is None:
        raise TokenizerError(
            f"unknown tokenizer.ggml.pre {pre_name!r}: runlm does not know how this vocabulary splits text "
            f"(known: {', '.join(sorted(BPE_PRE_TYPES))})"
        )
    return pre


def _native_byte_level(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int], pre: _Pre
) -> BpeEncoder | None:
    """The byte-level vocabulary encoded by the native library (runlm.text.bpe), or None where the `tokenizers` route
    takes it: a file without merges (they are made from the vocabulary there), or no library to run it."""
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not merges:
        return None
    try:
        bpe = BpeEncoder(tokens, types, merges, pre.patterns(), ignore_merges=pre.ignore_merges)
    except (RunlmError, OSError) as exc:
        log.debug("byte-level vocabulary left to the tokenizers library: %s", exc)
        return None
    bpe.add_tokens(_gguf_added_tokens(metadata, tokens, types, bpe.own_ids))
    return bpe


def _native_sentencepiece(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> SpmEncoder | None:
    """The SentencePiece vocabulary encoded by the native library (runlm.text.spm), or None where the `tokenizers`
    route takes it: a file that lists its merges, or no library to run it."""
    if isinstance(metadata.get("tokenizer.ggml.merges"), list) and metadata["tokenizer.ggml.merges"]:
        return None
    gemma, add_prefix = _spm_style(metadata)
    if gemma:  # GemmaTokenizer's normalizer puts ▁ before every piece of text between added tokens
        prefix = PREFIX_EACH_PIECE if add_prefix else PREFIX_NONE
    else:  # LlamaTokenizer's Metaspace only before the start of the text
        prefix = PREFIX_FIRST_PIECE if add_prefix else PREFIX_NONE
    pieces = _spm_pieces(metadata, tokens)
    try:
        ranking = _spm_ranking(metadata, len(tokens))
        spm = SpmEncoder(pieces, ranking, prefix=prefix, strip_one_space=add_prefix and not gemma)
    except (RunlmError, OSError) as exc:
        log.debug("SentencePiece vocabulary left to the tokenizers library: %s", exc)
        return None
    # the added tokens in the file's spelling: a respelled space run is a piece, and no text spells it with ▁

    def own(ids: list[int]) -> list[bool]:
        return [owned if pieces[i] == tokens[i] else spm.piece_id(tokens[i]) == i
                for i, owned in zip(ids, spm.own_ids(ids), strict=True)]

    spm.add_tokens(_gguf_added_tokens(metadata, tokens, types, own))
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    spm.set_unknown(spm.piece_id(pieces[unk_id]) if isinstance(unk_id, int) and 0 <= unk_id < len(tokens)
                    else None)
    return spm


def _cached_merges(
    metadata: Mapping[str, Any],
    tokens: list[str],
    types: list[int],
    vocab: Mapping[str, int],
    generate: Callable[[], list[tuple[str, str]]],
) -> list[tuple[str, str]]:
    """generate(), kept on disk as int32 (left, right) ids into `tokens`: a SentencePiece vocabulary of 262k pieces
    takes seconds to turn into BPE merges. Ids and not a tokenizer JSON: the merges then reuse the vocabulary's
    strings, and building the backend from them peaks at about half the memory that parsing Gemma's 33 MB tokenizer
    JSON takes (173 against 355 MiB), most of which glibc kept after the parse."""
    digest = hashlib.sha256(b"runlm-spm-merges-v2\x00")
    digest.update("\x00".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(np.asarray(types, dtype=np.int64).tobytes())
    for key in sorted(metadata):
        if key.startswith("tokenizer.ggml.") and key not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = metadata[key]
            if key == "tokenizer.ggml.scores":  # 262k numbers: their bytes, not their repr (a tenth of a second)
                value = np.asarray(value, dtype=np.float64).tobytes().hex()
            digest.update(f"{key}={value!r}\x00".encode("utf-8", "surrogatepass"))
    digest.update(f"arch={metadata.get('general.architecture')!r}".encode())
    path = runlm_home() / "tokenizers" / f"spm-merges-v2-{digest.hexdigest()[:32]}.npy"
    if path.is_file():
        try:
            ids = np.load(path, allow_pickle=False)
            if (
                ids.ndim == 2
                and ids.shape[1] == 2
                and ids.dtype == np.int32
                and (ids.size == 0 or (ids.min() >= 0 and ids.max() < len(tokens)))
            ):
                pieces = np.array(tokens, dtype=object)
                return list(zip(pieces[ids[:, 0]].tolist(), pieces[ids[:, 1]].tolist(), strict=True))
        except (OSError, ValueError):  # an unreadable cache entry is rebuilt
            pass
    merges = generate()
    ids = np.array([(vocab[a], vocab[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            np.save(out, ids, allow_pickle=False)
        tmp.replace(path)
        # whole tokenizers that runlm once kept here, and merges under the key that hashed the scores' repr
        for pattern in ("spm-" + "?" * 32 + ".json", "spm-merges-" + "?" * 32 + ".npy"):
            for legacy in path.parent.glob(pattern):
                legacy.unlink(missing_ok=True)
    except OSError:  # a read-only cache only costs the time
        pass
    return merges


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"{path}: cannot read ({exc})") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


class _EncodeModes:
    """Who may use the backend's encode modes: plain encodes share them; an encode that switches them for a moment
    (`Tokenizer.encode_text`) has the backend alone. A waiting switch goes before new plain encodes, so a stream of
    them cannot hold it back."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._sharing = 0
        self._switching = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._switching and not self._waiting)
            self._sharing += 1
        try:
            yield
        finally:
            with self._changed:
                self._sharing -= 1
                if not self._sharing:  # only a switch waits for the last plain encode
                    self._changed.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        with self._changed:
            self._waiting += 1
            self._changed.wait_for(lambda: not self._switching and not self._sharing)
            self._waiting -= 1
            self._switching = True
        try:
            yield
        finally:
            with self._changed:
                self._switching = False
                self._changed.notify_all()


def _never_prepending(pre: pre_tokenizers.PreTokenizer | None) -> pre_tokenizers.PreTokenizer | None:
    """A copy of `pre` whose Metaspace steps never prepend their ▁ (None where none prepends only to the start of
    the text, prepend_scheme "first"): how text after a special token is pre-tokenized, since "first" means the
    piece at the start of the whole input."""
    if pre is None:
        return None
    state = json.loads(pre.__getstate__())

    def never(node: Any) -> bool:
        changed = False
        if isinstance(node, dict):
            if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
                node["prepend_scheme"], changed = "never", True
            for value in node.values():
                changed = never(value) or changed
        elif isinstance(node, list):
            for value in node:
                changed = never(value) or changed
        return changed

    if not never(state):
        return None
    copy = pickle.loads(pickle.dumps(pre))
    copy.__setstate__(json.dumps(state).encode())
    return copy


class Tokenizer:
    """Text <-> token ids for one model, with its BOS/EOS conventions and end-of-turn tokens.

    Build it with `from_gguf` or `from_hf_dir`; the constructor takes an assembled `tokenizers` backend, or a
    vocabulary the native library encodes (`native`: SentencePiece or byte-level BPE) with a function that builds the
    backend should a caller ask for one.
    """

    def __init__(
        self,
        backend: _Backend | Callable[[], _Backend],
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        add_eos: bool = False,
        extra_stop_ids: Iterable[int] = (),
        byte_mode: str = "byte_level",
        strip_mode: tuple[str, int] = ("none", 0),
        fim_declared: Mapping[str, Any] | None = None,
        native: SpmEncoder | BpeEncoder | None = None,
        vocab_size: int | None = None,
    ):
        self._native = native
        self._backend: _Backend | None = None
        self._make_backend: Callable[[], _Backend] | None = None
        self._backend_made = threading.Lock()
        if native is None:
            assert isinstance(backend, _Backend)
            self._set_backend(backend)
            self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
            added_texts = {i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}
            self._pre_after_special = _never_prepending(backend.pre_tokenizer)
        else:
            self._make_backend = backend
            self.vocab_size = native.vocab_size
            added_texts = native.added
            self._pre_after_special = None
        if vocab_size is not None:  # the file's ids (a repeated spelling leaves fewer distinct pieces than ids)
            self.vocab_size = vocab_size
        self.bos_id = bos_id if bos_id is not None and 0 <= bos_id < self.vocab_size else None
        self.eos_id = eos_id if eos_id is not None and 0 <= eos_id < self.vocab_size else None
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self.add_eos = bool(add_eos) and self.eos_id is not None
        self.special_ids: frozenset[int] = frozenset(i for i, (_, special) in added_texts.items() if special)
        stops = {i for i in extra_stop_ids if 0 <= i < self.vocab_size}
        if self.eos_id is not None:
            stops.add(self.eos_id)
        # control or user-defined tokens (added ones, never pieces of text), as llama.cpp takes them
        specials = {text: i for text in EOG_TOKEN_TEXTS if (i := self.token_to_id(text)) in added_texts}
        if "<|return|>" in specials and "<|call|>" in specials:  # harmony: <|end|> ends a message, not the turn
            specials.pop("<|end|>", None)
            stops.discard(self.token_to_id("<|end|>"))
        stops.update(specials.values())
        self.stop_ids: frozenset[int] = frozenset(stops)
        # How one token's text becomes bytes, mirroring the decoder (see token_to_bytes).
        self._byte_mode = byte_mode
        # Leading spaces the decoder strips from a sequence: ("string", n) from the whole text (Strip
        # decoder), ("first_token", 1) from the first token only (Metaspace decoder), or ("none", 0).
        self.strip_mode = strip_mode
        self._bytes_cache: dict[int, bytes] = {}
        self._modes = _EncodeModes()
        # Fill-in-the-middle roles -> ids: as the file declares them, else found by token text (runlm.text.fim).
        self.fim_ids: dict[str, int] = find_fim_ids(fim_declared or {}, self.token_to_id, self.vocab_size)
        self.fim: FimTokens | None = fim_tokens(self.fim_ids, self.token_to_id)

    def _set_backend(self, backend: _Backend) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any] | str | Path) -> Tokenizer:
        """The tokenizer a GGUF's `tokenizer.ggml.*` metadata describes (or a GGUF file's path)."""
        if isinstance(metadata, (str, Path)):
            metadata = GGUFFile(metadata).metadata
        with collection_paused():  # hundreds of thousands of merge pairs, none of them in a cycle
            return cls._from_gguf(metadata)

    @classmethod
    def _from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        _check_gguf_tokenizer_types(metadata)
        model = metadata.get("tokenizer.ggml.model")
        native: SpmEncoder | BpeEncoder | None = None
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens vocabulary")
        types = metadata.get("tokenizer.ggml.token_type")
        if not isinstance(types, list) or len(types) != len(tokens):
            types = [_NORMAL] * len(tokens)
        if model == "gpt2":
            pre = _bpe_pre(metadata)
            native = _native_byte_level(metadata, tokens, types, pre)
            if native is not None:  # the `tokenizers` backend only where a caller asks for it
                backend = functools.partial(cls._gguf_byte_level, metadata, tokens, types)
            else:
                backend = cls._gguf_byte_level(metadata, tokens, types)
            default_add_bos = pre.add_bos
            byte_mode, strip_mode = "byte_level", ("none", 0)
        elif model == "gemma4":
            backend = cls._gguf_gemma4(metadata, tokens, types)
            default_add_bos, byte_mode, strip_mode = True, "spm", ("none", 0)
        elif model == "llama":
            native = _native_sentencepiece(metadata, tokens, types)
            if native is not None:  # the `tokenizers` backend only where a caller asks for it
                backend = functools.partial(cls._gguf_sentencepiece, metadata, tokens, types)
            else:
                backend = cls._gguf_sentencepiece(metadata, tokens, types)
            gemma, add_prefix = _spm_style(metadata)
            # llama-style decoding drops the dummy prefix the encoder adds (see _gguf_sentencepiece)
            strip_mode = ("string", 1) if add_prefix and not gemma else ("none", 0)
            default_add_bos = True
            byte_mode = "spm"
        else:
            raise TokenizerError(
                f"unsupported GGUF tokenizer model {_short(model)} (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece, 'gemma4')"
            )

        def token_id(key: str) -> int | None:
            value = metadata.get(f"tokenizer.ggml.{key}")
            return value if isinstance(value, int) and 0 <= value < len(tokens) else None

        add_bos = metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)
        add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
        extra_stops = [i for i in (token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
        # fim_<role>_token_id, or the older prefix / suffix / middle_token_id names
        legacy = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
        fim = {role: token_id(f"fim_{role}_token_id") for role in FIM_ROLES}
        fim |= {role: token_id(f"{name}_token_id") for role, name in legacy.items() if fim[role] is None}
        return cls(
            backend,
            bos_id=token_id("bos_token_id"),
            eos_id=token_id("eos_token_id"),
            add_bos=bool(add_bos),
            add_eos=bool(add_eos),
            extra_stop_ids=extra_stops,
            byte_mode=byte_mode,
            strip_mode=strip_mode,
            fim_declared=fim,
            native=native,
            vocab_size=len(tokens),
        )

    @staticmethod
    def _gguf_byte_level(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> _Backend:
        """Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM...): vocabulary + merges + a split regex."""
        pre = _bpe_pre(metadata)
        if not outside_byte_alphabet().search("".join(tokens)):
            vocab = dict(zip(tokens, range(len(tokens))))
        else:  # some tokens are written as raw text: respell them the way byte-level BPE produces them
            vocab = {vocabulary_spelling(token, kind): index
                     for index, (token, kind) in enumerate(zip(tokens, types, strict=True))}
        raw_merges = metadata.get("tokenizer.ggml.merges")
        if isinstance(raw_merges, list) and raw_merges:
            merges = [_split_merge(merge, 1) for merge in raw_merges]
        else:
            merges = _generate_merges(vocab, {t: -i for t, i in vocab.items()})
        try:
            bpe = models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                ignore_merges=pre.ignore_merges,
            )
        except Exception as exc:
            raise TokenizerError(f"cannot build the byte-level BPE model: {exc}") from exc
        backend = _Backend(bpe)
        backend.pre_tokenizer = pre.build()
        backend.decoder = decoders.ByteLevel()
        _add_gguf_special_tokens(backend, metadata, tokens, types, vocab)
        return backend

    @staticmethod
    def _gguf_sentencepiece(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> _Backend:
        """SentencePiece BPE (Llama 2, Mistral, Gemma...): vocabulary + scores, byte fallback, ▁ for spaces."""
        gemma, add_prefix = _spm_style(metadata)
        original = tokens
        tokens = _spm_pieces(metadata, tokens)
        vocab = {token: index for index, token in enumerate(tokens)}
        raw_merges = metadata.get("tokenizer.ggml.merges")
        if isinstance(raw_merges, list) and raw_merges:
            merges = [_split_merge(m) for m in raw_merges]
        else:

            def generate() -> list[tuple[str, str]]:
                ranking = dict(zip(tokens, _spm_ranking(metadata, len(tokens)).tolist(), strict=True))
                return _generate_merges(vocab, ranking)

            merges = _cached_merges(metadata, tokens, types, vocab, generate)
        unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk, fuse_unk=True, byte_fallback=True)
        except Exception as exc:
            raise TokenizerError(f"cannot build the SentencePiece BPE model: {exc}") from exc
        backend = _Backend(bpe)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if gemma:
            # GemmaTokenizer: spaces become ▁ in the normalizer, no pre-tokenizer split.
            norms = [normalizers.Replace(" ", "▁")]
            if add_prefix:
                norms.insert(0, normalizers.Prepend("▁"))
            backend.normalizer = norms[0] if len(norms) == 1 else normalizers.Sequence(norms)
        else:
            # LlamaTokenizer: Metaspace adds the dummy prefix to the first piece, the decoder drops it.
            backend.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
            )
            if add_prefix:
                steps.append(decoders.Strip(content=" ", left=1, right=0))
        backend.decoder = decoders.Sequence(steps)
        # Respelled space runs are not added tokens: the text spells them with spaces, never with ▁.
        _add_gguf_special_tokens(backend, metadata, original, types, vocab)
        return backend

    @staticmethod
    def _gguf_gemma4(metadata: Mapping[str, Any], tokens: list[str], types: list[int]) -> _Backend:
        """Gemma 4's BPE over raw UTF-8 (as llama.cpp reads it): spaces become ▁, the text is cut only between runs
        of newlines and the rest, a run of newlines the vocabulary holds whole is that one token, and bytes no piece
        covers fall back to <0xNN> tokens. The file lists its merges."""
        raw_merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(raw_merges, list) or not raw_merges:
            raise TokenizerError("a gemma4 tokenizer needs tokenizer.ggml.merges, and this file has none")
        vocab = {token: index for index, token in enumerate(tokens)}
        unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
        try:
            bpe = models.BPE(vocab=vocab, merges=[_split_merge(m, 1) for m in raw_merges], dropout=None,
                             unk_token=unk, fuse_unk=True, byte_fallback=True)
        except Exception as exc:
            raise TokenizerError(f"cannot build the gemma4 BPE model: {exc}") from exc
        backend = _Backend(bpe)
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), behavior="isolated")
        backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
        _add_gguf_special_tokens(backend, metadata, tokens, types, vocab)
        return backend

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face tokenizer directory: tokenizer.json, plus tokenizer_config.json and
        generation_config.json for BOS/EOS, add_bos and extra added tokens."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(f"{root}: no tokenizer.json")
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:
            raise TokenizerError(f"{tokenizer_file}: cannot load ({exc})") from exc
        config_file = root / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}

        # Added tokens the config declares but tokenizer.json lacks (old checkpoints).
        known = backend.get_added_tokens_decoder()
        declared = config.get("added_tokens_decoder") or {}
        if not isinstance(declared, Mapping):
            raise TokenizerError(f"{config_file}: added_tokens_decoder must be an object")
        for raw_id, spec in declared.items():
            content = token_text(spec)
            if content is None or not str(raw_id).isdigit() or int(raw_id) in known:
                continue
            token_id = int(raw_id)
            if backend.token_to_id(content) == token_id or token_id == backend.get_vocab_size(True):
                special = bool(spec.get("special", True)) if isinstance(spec, Mapping) else True
                token = AddedToken(content, special=special, normalized=not special)
                (backend.add_special_tokens if special else backend.add_tokens)([token])

        def lookup(key: str) -> int | None:
            text = token_text(config.get(key))
            return backend.token_to_id(text) if text is not None else None

        bos_id, eos_id = lookup("bos_token"), lookup("eos_token")
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No flag: the template post-processor says whether the reference adds BOS.
            add_bos = bos_id is not None and _post_processor_adds(backend, bos_id)
        add_eos = config.get("add_eos_token") is True
        extra_stops: list[int] = []
        generation_file = root / "generation_config.json"
        if generation_file.is_file():
            generation = _read_json(generation_file)
            eos = generation.get("eos_token_id")
            extra_stops = [eos] if isinstance(eos, int) else [i for i in eos or () if isinstance(i, int)]
            if eos_id is None and extra_stops:
                eos_id = extra_stops[0]
            if bos_id is None and isinstance(generation.get("bos_token_id"), int):
                bos_id = generation["bos_token_id"]
        byte_mode, strip_mode = _decoder_modes(json.loads(backend.to_str()).get("decoder"))
        return cls(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            add_bos=add_bos,
            add_eos=add_eos,
            extra_stop_ids=extra_stops,
            byte_mode=byte_mode,
            strip_mode=strip_mode,
        )

    # ------------------------------------------------------------------ API

    @property
    def backend(self) -> _Backend:
        """The `tokenizers.Tokenizer` that encodes as this one does (for batch work or inspection); built on first use
        where the native library encodes."""
        if self._backend is None:
            with self._backend_made:
                if self._backend is None:
                    assert self._make_backend is not None
                    with collection_paused():
                        self._set_backend(self._make_backend())
        assert self._backend is not None
        return self._backend

    def token_to_id(self, text: str) -> int | None:
        """The id of an added token or vocabulary piece spelled `text`, or None."""
        if self._native is not None:
            return self._native.token_to_id(text)
        return self.backend.token_to_id(text)

    def added_tokens(self) -> dict[int, AddedToken]:
        """The tokens matched whole in text (special or not), by id."""
        if self._native is not None:
            return {i: AddedToken(text, special=special, normalized=False) for i, (text, special) in
                    self._native.added.items()}
        return self.backend.get_added_tokens_decoder()

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_start|>`) become their ids.

        `add_bos`/`add_eos` None follows the model's convention (GGUF `add_bos_token`, tokenizer_config).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        if self._native is not None:
            ids = self._native.encode(text)
        else:
            # encode_batch, not encode: the same ids, but it lets go of the GIL while it works (a megabyte of text
            # takes 0.3 s), so a server's event loop keeps answering while a worker thread tokenizes.
            with self._modes.shared():
                ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def encode_text(self, text: str, after_special: bool = False) -> list[int]:
        """Token ids of `text` with every special-token string in it read as plain text (no BOS / EOS), as the
        tokenizer encodes text that follows a special token where `after_special` (a SentencePiece "first" prefix
        is then not added). The one backend switches its modes for the call (`_EncodeModes`: plain encodes wait),
        so no second copy of a large vocabulary is held for it."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode_text() takes a str, got {type(text).__name__}")
        if self._native is not None:
            return self._native.encode(text, specials_as_text=True, after_special=after_special)
        backend = self.backend
        swap = after_special and self._pre_after_special is not None
        with self._modes.alone():
            plain_pre, plain_specials = backend.pre_tokenizer, backend.encode_special_tokens
            backend.encode_special_tokens = True
            if swap:
                backend.pre_tokenizer = self._pre_after_special
            try:
                return backend.encode_batch([text], add_special_tokens=False)[0].ids
            finally:
                backend.encode_special_tokens = plain_specials
                if swap:
                    backend.pre_tokenizer = plain_pre

    def encode_with_post_processor(self, text: str) -> tuple[list[int], list[int]]:
        """The backend's own ids of `text` without and with its post-processor's special tokens."""
        if self._native is not None:  # a GGUF vocabulary, whose backend has no post-processor
            ids = self._native.encode(text)
            return ids, list(ids)
        backend = self.backend
        with self._modes.shared():
            return (backend.encode(text, add_special_tokens=False).ids,
                    backend.encode(text, add_special_tokens=True).ids)

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt: the model's BOS convention, but never a second BOS when the text
        (a rendered chat template, say) already starts with one."""
        ids = self.encode(text)
        if self.bos_id is not None and len(ids) >= 2 and ids[0] == ids[1] == self.bos_id:
            ids = ids[1:]
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of `ids`; special tokens are written out unless `skip_special`."""
        checked = self._check_ids(ids)
        if self._native is not None:
            return self._native.decode(checked, skip_special)
        return self.backend.decode(checked, skip_special_tokens=skip_special)

    def token_str(self, token_id: int) -> str:
        """The vocabulary's spelling of a token ('Ġhello', '▁hello', '<0x0A>', '<|im_end|>')."""
        (token_id,) = self._check_ids([token_id])
        text = self._native.id_to_token(token_id) if self._native is not None else self.backend.id_to_token(token_id)
        if text is None:
            raise TokenizerError(f"token id {token_id} has no entry in the vocabulary")
        return text

    def is_special(self, token_id: int) -> bool:
        """Whether `decode(..., skip_special=True)` drops this token."""
        return int(token_id) in self.special_ids

    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes this token contributes to decoded text, possibly part of one UTF-8 character.

        Streaming needs bytes, not text: an emoji split over byte tokens has no text until its last
        byte arrives. Follows the decoder: byte-level spelling, or ▁ / <0xNN> byte fallback.
        """
        cached = self._bytes_cache.get(token_id)
        if cached is not None:
            return cached
        token = self.token_str(token_id)
        if self._byte_mode == "byte_level":
            data = spelled_bytes(token)
        elif self._byte_mode == "spm":
            match = _BYTE_TOKEN.fullmatch(token)
            data = bytes([int(match.group(1), 16)]) if match else token.replace("▁", " ").encode("utf-8")
        else:
            data = self.decode([token_id]).encode("utf-8")
        self._bytes_cache[token_id] = data
        return data

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        try:
            checked = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise TokenizerError("token ids must be integers") from None
        for i in checked:
            if not 0 <= i < self.vocab_size:
                raise TokenizerError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return checked

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"add_bos={self.add_bos}, stop_ids={sorted(self.stop_ids)})"
        )


def _gguf_added_tokens(
    metadata: Mapping[str, Any], tokens: list[str], types: list[int], own: Callable[[list[int]], Iterable[bool]]
) -> dict[int, tuple[str, bool]]:
    """The tokens matched whole in text, id -> (text, special): control tokens special, user-defined ones plain
    (llama.cpp does the same; without this `<|im_start|>` is cut into pieces). A token counts where the vocabulary
    finds its text at its id (`own` says which of some ids do)."""
    try:
        kinds = np.asarray(types, dtype=np.int64)
    except OverflowError:
        raise TokenizerError("GGUF metadata tokenizer.ggml.token_type holds a type past 64 bits") from None
    specials = set(np.flatnonzero(kinds == _CONTROL).tolist())
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and 0 <= value < len(tokens):
            specials.add(value)
    control = sorted(specials)
    user = [i for i in np.flatnonzero(kinds == _USER_DEFINED).tolist() if i not in specials]
    added = {i: (tokens[i], True) for i, owned in zip(control, own(control), strict=True) if owned}
    added.update((i, (tokens[i], False)) for i, owned in zip(user, own(user), strict=True) if owned)
    return added


def _add_gguf_special_tokens(
    backend: _Backend, metadata: Mapping[str, Any], tokens: list[str], types: list[int], vocab: Mapping[str, int]
) -> None:
    """Register the file's added tokens (_gguf_added_tokens) with the backend."""
    added = _gguf_added_tokens(metadata, tokens, types, lambda ids: [vocab.get(tokens[i]) == i for i in ids])
    control = [AddedToken(text, special=True, normalized=False) for text, special in added.values() if special]
    user = [AddedToken(text, special=False, normalized=False) for text, special in added.values() if not special]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


def _post_processor_adds(backend: _Backend, bos_id: int) -> bool:
    """Whether the backend's post-processor puts BOS in front of a single sequence."""
    try:
        with_specials = backend.encode("a", add_special_tokens=True).ids
        without = backend.encode("a", add_special_tokens=False).ids
    except Exception:
        return False
    return bool(with_specials) and with_specials[0] == bos_id and (not without or without[0] != bos_id)


def _decoder_modes(decoder: Mapping[str, Any] | None) -> tuple[str, tuple[str, int]]:
    """(byte mode, strip mode) for token_to_bytes and streaming, read from a tokenizer.json decoder."""
    steps = decoder.get("decoders", [decoder]) if isinstance(decoder, Mapping) else []
    steps = [s for s in steps if isinstance(s, Mapping)]
    kinds = {s.get("type") for s in steps}
    strip: tuple[str, int] = ("none", 0)
    for step in steps:
        if step.get("type") == "Strip" and step.get("content") == " " and int(step.get("start", 0)) > 0:
            strip = ("string", int(step["start"]))
        if step.get("type") == "Metaspace":
            scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
            if scheme != "never":
                strip = ("first_token", 1)
    if "ByteLevel" in kinds:
        return "byte_level", strip
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        return "spm", strip
    return "other", strip
