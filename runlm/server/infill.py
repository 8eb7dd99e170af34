"""Fill-in-the-middle prompts for every API that asks for one: llama-server's /infill, OpenAI completions'
`suffix`, Ollama generate's `suffix`. The layout is runlm.text.fim's; here it meets the served model, whose
vocabulary may have no FIM tokens (a 400 naming them, in the shape of the API called)."""

from __future__ import annotations

from collections.abc import Sequence

from runlm.server.errors import APIError
from runlm.server.state import ServerState
from runlm.text.fim import FIM_TEXTS, ExtraChunk, FimTokens, infill_ids, missing_fim_roles


def served_fim(state: ServerState, param: str) -> FimTokens:
    """The served model's FIM tokens, or a 400 naming the ones its vocabulary lacks."""
    tok = state.tokenizer
    fim = getattr(tok, "fim", None)
    if fim is not None:
        return fim
    missing = missing_fim_roles(getattr(tok, "fim_ids", {}))
    looked_for = ", ".join(FIM_TEXTS[role.removeprefix("fim_")][0] for role in missing)
    raise APIError(400, f"this model has no fill-in-the-middle tokens: its vocabulary lacks {', '.join(missing)} "
                        f"(no token such as {looked_for}, nor tokenizer.ggml.fim_*_token_id keys in its file)",
                   param=param, code="fim_not_supported")


def fim_request(state: ServerState, prefix: str, suffix: str, *, extra: Sequence[ExtraChunk] = (),
                prompt: str = "", param: str = "suffix") -> tuple[list[int], frozenset[int]]:
    """(prompt ids, stop ids) of an infill: the model's end-of-generation tokens plus the FIM ones that close a
    middle (pad, file separator ...)."""
    fim = served_fim(state, param)
    ids = infill_ids(state.tokenizer, fim, prefix, suffix, extra, prompt)
    state.engine.check_prompt(ids)
    return ids, frozenset(state.tokenizer.stop_ids) | fim.ends
