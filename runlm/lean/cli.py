"""`runlm generate --lean`: one completion from a process that never imports PyTorch (runlm.launch sends the command
here first). The model is prepared once into a lean image (a child process with PyTorch does it); this process
maps the image, builds the tokenizer from the GGUF, and streams the reply."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from runlm import catalog
from runlm.cli_args import add_generate_arguments, exit_status, terminal_safe
from runlm.errors import InvalidInputError, RunlmError, TokenizerError
from runlm.formats.gguf import GGUFFile
from runlm.lean.engine import LeanModel
from runlm.lean.prepare import image_for
from runlm.text import ChatTemplate, StreamingDetokenizer, Tokenizer

# --kv-type auto is f16 here, as on the default path for quantized GGUF weights
_KV_TYPES = {"auto": "f16", "f16": "f16", "f32": "f32", "q8_0": "q8_0"}


class Sampler:
    """Greedy at temperature 0; else temperature, top-k then top-p (nucleus) over a softmax, numpy's generator
    seeded by `seed`. The PyTorch path's sampler draws other numbers for the same seed: greedy replies are the same
    tokens, sampled ones are not."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int | None):
        if temperature < 0 or not 0 < top_p <= 1:
            raise InvalidInputError("temperature must be >= 0 and top_p in (0, 1]")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < scaled.size:
            cutoff = np.partition(scaled, -self.top_k)[-self.top_k]
            scaled = np.where(scaled >= cutoff, scaled, -np.inf)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        if self.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            keep = np.cumsum(probs[order]) - probs[order] < self.top_p  # the smallest prefix reaching top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0)
            probs /= probs.sum()
        return int(self.rng.choice(probs.size, p=probs))


def generate(model: LeanModel, prompt_ids: list[int], max_tokens: int, sampler: Sampler,
             stop_ids: frozenset[int]) -> Iterator[int]:
    """Token ids of the reply, one at a time, until a stop id (not yielded) or max_tokens."""
    positions = min(len(prompt_ids) + max_tokens, model.context)
    if len(prompt_ids) >= positions:
        raise InvalidInputError(f"the prompt's {len(prompt_ids)} tokens leave no room in the context of {positions}")
    session = model.new_session(positions)
    logits = model.extend(session, prompt_ids)
    for produced in range(max_tokens):
        token = sampler(logits)
        if token in stop_ids:
            return
        yield token
        if produced + 1 == max_tokens or len(session.tokens) == positions:
            return
        logits = model.extend(session, [token])


def _refuse_options(args: argparse.Namespace) -> None:
    refused = {
        "--image": args.image is not None, "--mmproj": args.mmproj is not None,
        "--dtype": args.dtype != "auto", "--device": args.device not in (None, "cpu"), "--swa-full": args.swa_full,
    }  # fmt: skip
    named = [name for name, given in refused.items() if given]
    if named:
        raise InvalidInputError(f"{', '.join(named)}: not with --lean (it runs GGUF text models on the CPU kernels)")


def run(args: argparse.Namespace) -> int:
    """`runlm generate --lean` with parsed arguments."""
    _refuse_options(args)
    if args.max_tokens < 1:
        raise RunlmError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    path = catalog.resolve_model(args.model)
    image = image_for(path, log=lambda line: print(line, file=sys.stderr))
    model = LeanModel.open(image, kv_type=_KV_TYPES[args.kv_type], threads=args.threads)
    if args.ctx is not None:
        if args.ctx < 1:
            raise InvalidInputError(f"--ctx must be positive, got {args.ctx}")
        model.context = min(model.context, args.ctx)
    tokenizer = Tokenizer.from_gguf(GGUFFile(path).metadata)
    template = _chat_template(args, model, tokenizer)
    if args.raw or template is None:
        text = args.prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        text = template.render([*system, {"role": "user", "content": args.prompt}])
    sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
    detok = StreamingDetokenizer(tokenizer, continuation=True)
    shown = terminal_safe if sys.stdout.isatty() else str
    for token in generate(model, tokenizer.encode_prompt(text), args.max_tokens, sampler, tokenizer.stop_ids):
        piece = detok.push(token)
        if piece:
            sys.stdout.write(shown(piece))
            sys.stdout.flush()
    sys.stdout.write(shown(detok.flush()) + "\n")
    return 0


def _chat_template(args: argparse.Namespace, model: LeanModel, tokenizer: Tokenizer) -> ChatTemplate | None:
    if args.chat_template_file:
        try:
            with open(args.chat_template_file, encoding="utf-8") as file:
                source = file.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"--chat-template-file {args.chat_template_file}: {exc}") from None
        bos, eos = (None if i is None else tokenizer.token_str(i) for i in (tokenizer.bos_id, tokenizer.eos_id))
        return ChatTemplate(source, bos_token=bos, eos_token=eos)
    saved = model.header["chat_template"]
    return None if saved is None else ChatTemplate(saved["source"], bos_token=saved["bos_token"],
                                                   eos_token=saved["eos_token"], name=saved["name"])


def main(argv: Sequence[str]) -> int:
    """`runlm generate --lean ...` (argv after "generate")."""
    parser = argparse.ArgumentParser(prog="runlm generate")
    add_generate_arguments(parser)
    args = parser.parse_args(argv)
    return exit_status(lambda: run(args))


__all__ = ["Sampler", "generate", "main", "run"]
