"""Fill-in-the-middle: which tokens of a vocabulary mark the prefix, suffix and middle, and the infill prompt.

A GGUF may declare the ids (`tokenizer.ggml.fim_pre_token_id` ... `fim_sep_token_id`); where it does not, they
are found by token text, as llama.cpp finds them (StarCoder's `<fim_prefix>`, Qwen2.5-Coder's and CodeGemma's
`<|fim_prefix|>`, CodeLlama's `<PRE>` / `▁<PRE>`, DeepSeek-Coder's `<｜fim▁begin｜>` ...). A model has FIM when
it has all three of prefix, suffix and middle; pad, repo and file-separator tokens are optional.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")
REQUIRED_ROLES = ("pre", "suf", "mid")

# Token texts per role, in llama.cpp's order of preference (the first one present wins).
FIM_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# Tokens that end an infilled middle besides EOS / end-of-turn: CodeGemma's end of file, CodeLlama's end of infill.
FIM_END_TEXTS = ("<|file_separator|>", "<EOT>", "▁<EOT>")

# llama-server's placeholders in the repo-level layout (it takes no project or file name either).
REPO_NAME, FILE_NAME = "myproject", "filename"


@dataclass(frozen=True)
class FimTokens:
    """A vocabulary's fill-in-the-middle token ids; `ends` are the ids that close a middle (pad, repo, file
    separator, an end-of-file token), which llama.cpp counts as end of generation."""

    pre: int
    suf: int
    mid: int
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None
    ends: frozenset[int] = frozenset()


def find_fim_ids(declared: Mapping[str, Any], token_id: Callable[[str], int | None], vocab_size: int) -> dict[str, int]:
    """Role -> id for every FIM role the model has: the declared id (a GGUF's `fim_<role>_token_id`) where it
    is a valid id, else the first of the role's known texts in the vocabulary (`token_id(text)`)."""
    found: dict[str, int] = {}
    for role in FIM_ROLES:
        value = declared.get(role)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
            found[role] = value
            continue
        for text in FIM_TEXTS[role]:
            tid = token_id(text)
            if tid is not None:
                found[role] = tid
                break
    return found


def fim_tokens(ids: Mapping[str, int], token_id: Callable[[str], int | None]) -> FimTokens | None:
    """The FimTokens of `ids` (find_fim_ids' result), or None without all of prefix, suffix and middle."""
    if any(role not in ids for role in REQUIRED_ROLES):
        return None
    ends = {ids[r] for r in ("pad", "rep", "sep") if r in ids}
    ends |= {t for t in map(token_id, FIM_END_TEXTS) if t is not None}
    return FimTokens(ids["pre"], ids["suf"], ids["mid"], ids.get("pad"), ids.get("rep"), ids.get("sep"),
                     frozenset(ends))


def missing_fim_roles(ids: Mapping[str, int]) -> list[str]:
    """The required roles a vocabulary lacks, as `fim_pre` ... (for error messages)."""
    return [f"fim_{role}" for role in REQUIRED_ROLES if role not in ids]


@dataclass(frozen=True)
class ExtraChunk:
    """Context from another file (llama-server's `input_extra` item)."""

    filename: str
    text: str


def infill_ids(tokenizer: Any, fim: FimTokens, prefix: str, suffix: str, extra: Sequence[ExtraChunk] = (),
               prompt: str = "") -> list[int]:
    """The prompt of a fill-in-the-middle request, prefix-suffix-middle order:

        [BOS] [extra context] [fim_pre] prefix [fim_suf] suffix [fim_mid] prompt

    Client text is tokenized as text (special-token strings in code stay text). Extra chunks use llama-server's
    repo-level layout, and only where the vocabulary has a file separator (otherwise they are left out):
    [fim_rep] myproject\\n, then [fim_sep] filename\\n text for each chunk, then [fim_sep] filename\\n for the file
    being edited. `prompt` is the start of the middle, already written (llama-server's README places it after
    fim_mid).
    """

    def text(value: str) -> list[int]:
        return tokenizer.encode_text(value, after_special=True) if value else []

    ids: list[int] = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    if extra and fim.sep is not None:
        if fim.rep is not None:
            ids += [fim.rep, *text(f"{REPO_NAME}\n")]
        for chunk in extra:
            ids += [fim.sep, *text(f"{chunk.filename}\n"), *text(chunk.text)]
        ids += [fim.sep, *text(f"{FILE_NAME}\n")]
    ids += [fim.pre, *text(prefix), fim.suf, *text(suffix), fim.mid, *text(prompt)]
    return ids
