"""`runlm generate`, `runlm chat` and `runlm serve` in a process that never imports PyTorch, wherever the model and
the flags allow it (runlm.launch sends these commands here first; `--lean` insists, `--torch` declines). The model is
prepared once into a lean image (a child process with PyTorch does it); this process maps the image, builds the
tokenizer from the GGUF, and streams the replies, or serves them through runlm.server over a LeanRunner."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from runlm import catalog
from runlm.cli_args import (
    add_chat_arguments,
    add_generate_arguments,
    add_serve_arguments,
    chat_loop,
    chat_web,
    exit_status,
    read_template_file,
    sampling_params,
    serve_options,
    terminal_safe,
)
from runlm.errors import ContextOverflowError, InvalidInputError, RunlmError
from runlm.formats.gguf import GGUFFile, quantization_of
from runlm.native.model import LeanModel, LeanSession
from runlm.native.image import LeanRefusal
from runlm.native.prepare import image_for
from runlm.native.runner import LeanConfig, LeanLoaded, LeanRunner
from runlm.quant import build
from runlm.sampling import Sampler, SamplingParams
from runlm.system import release_free_heap
from runlm.text import ChatTemplate, StreamingDetokenizer, Tokenizer

# --kv-type auto is f16 here, as on the default path for quantized GGUF weights
_KV_TYPES = {"auto": "f16", "f16": "f16", "f32": "f32", "q8_0": "q8_0"}


def reply(model: LeanModel, session: LeanSession, prompt_ids: list[int], max_tokens: int, params: SamplingParams,
          stop_ids: frozenset[int]) -> Iterator[int]:
    """Token ids of the reply to `prompt_ids`, one at a time, until a stop id (not yielded) or max_tokens. The
    session keeps what it already holds of the prompt (the turns before, in a chat) and runs only the rest; the
    reply's tokens stay in it. The sampler is the PyTorch path's (runlm.sampling), seeded per reply as there, so a
    seeded reply is the same tokens on both paths."""
    sampler = Sampler(params, model.vocab_size, history=prompt_ids)
    if len(prompt_ids) >= session.capacity:
        raise ContextOverflowError(f"the prompt's {len(prompt_ids)} tokens leave no room in the context of "
                                   f"{session.capacity}")
    kept = min(model.reusable(session, prompt_ids), len(prompt_ids) - 1)  # the last prompt token gives the logits
    del session.tokens[kept:]
    logits = model.extend(session, prompt_ids[kept:])
    for produced in range(max_tokens):
        token = sampler(logits)
        if token in stop_ids:
            return
        yield token
        if produced + 1 == max_tokens or len(session.tokens) == session.capacity:
            return
        logits = model.extend(session, [token])


def torch_only_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that only the PyTorch path takes."""
    wanted = {
        "--image": getattr(args, "image", None) is not None, "--mmproj": getattr(args, "mmproj", None) is not None,
        "--dtype": args.dtype != "auto",
        "--device": args.device not in (None, "cpu"), "--swa-full": args.swa_full,
        "--replicas": any(getattr(args, name, None) is not None
                          for name in ("replicas", "min_replicas", "max_replicas")),
    }  # fmt: skip
    return [name for name, given in wanted.items() if given]


def _refuse_options(args: argparse.Namespace) -> None:
    named = torch_only_flags(args)
    if named:
        raise InvalidInputError(f"{', '.join(named)}: not with --lean (it runs GGUF text models on the CPU kernels)")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise InvalidInputError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.ctx is not None and args.ctx < 1:
        raise InvalidInputError(f"--ctx must be positive, got {args.ctx}")


def _open(args: argparse.Namespace) -> tuple[LeanModel, Tokenizer, ChatTemplate | None, Path, GGUFFile]:
    """The model (its image made first where there is none), its tokenizer and chat template, and its file."""
    _refuse_options(args)
    template_source = read_template_file(args.chat_template_file) if args.chat_template_file else None
    path = catalog.resolve_model(args.model)
    image = image_for(path, log=_note)
    model = LeanModel.open(image, kv_type=_KV_TYPES[args.kv_type], threads=args.threads)
    if args.ctx is not None:
        model.context = min(model.context, args.ctx)
    gguf = GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(gguf.metadata)
    release_free_heap()  # the tokenizer's build scratch, before the weights' pages come on top of it (as runlm.load)
    return model, tokenizer, _chat_template(args, template_source, model, tokenizer), path, gguf


def _stream(model: LeanModel, session: LeanSession, tokenizer: Tokenizer, prompt_ids: list[int],
            args: argparse.Namespace) -> str:
    """Print the reply to a tokenized prompt as it is produced; return its text."""
    detok = StreamingDetokenizer(tokenizer, continuation=True)
    shown = terminal_safe if sys.stdout.isatty() else str
    pieces = []
    for token in reply(model, session, prompt_ids, args.max_tokens, sampling_params(args), tokenizer.stop_ids):
        pieces.append(detok.push(token))
        sys.stdout.write(shown(pieces[-1]))
        sys.stdout.flush()
    pieces.append(detok.flush())
    sys.stdout.write(shown(pieces[-1]) + "\n")
    return "".join(pieces)


def run(args: argparse.Namespace) -> int:
    """`runlm generate --lean` with parsed arguments."""
    model, tokenizer, template, _, _ = _open(args)
    if args.raw or template is None:
        text = args.prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        text = template.render([*system, {"role": "user", "content": args.prompt}])
    prompt_ids = tokenizer.encode_prompt(text)
    positions = min(len(prompt_ids) + args.max_tokens, model.context)
    _stream(model, model.new_session(positions), tokenizer, prompt_ids, args)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    """`runlm chat --lean`: the turns share one session, so each turn runs only what the session does not hold
    (`--web`: the chat page, served by `serve --lean`)."""
    if args.web:
        return chat_web(args, run_serve)
    model, tokenizer, template, _, _ = _open(args)
    if template is None:
        raise RunlmError(f"{args.model or 'the model'}: the model has no chat template; use `runlm generate --raw`")
    session = model.new_session(model.context)  # its caches take memory as positions are written, not before
    sampling_params(args).validate(model.vocab_size)  # a bad flag fails before the first turn is typed
    source, family = Path(model.header["source"]["path"]).name, model.header["family"]
    print(f"runlm chat: {source} ({family}, without PyTorch). Empty line or Ctrl-D to quit.", file=sys.stderr)
    return chat_loop(args.system,
                     lambda messages: _stream(model, session, tokenizer,
                                              tokenizer.encode_prompt(template.render(messages)), args))


def run_serve(args: argparse.Namespace) -> int:
    """`runlm serve --lean`: the same server (every API, the scheduler, the prompt cache) over a LeanRunner."""
    from runlm.server import serve  # optional: the [server] extra

    options = serve_options(args)
    model, tokenizer, template, path, gguf = _open(args)
    loaded = LeanLoaded(LeanRunner(model), tokenizer, template, path, quantization_of(gguf),
                        LeanConfig(hidden_size=model.hidden, num_layers=len(model.header["blocks"])),
                        metadata=gguf.metadata)
    serve(loaded, host=args.host, port=args.port, prompt_cache_mb=args.prompt_cache_mb, max_queue=args.max_queue,
          max_batch=args.parallel, kv_budget_mb=args.kv_budget_mb, **options)
    return 0


def _chat_template(args: argparse.Namespace, source: str | None, model: LeanModel,
                   tokenizer: Tokenizer) -> ChatTemplate | None:
    """--chat-template-file's template (its text in `source`), else the model's own."""
    if source is not None:
        bos, eos = (None if i is None else tokenizer.token_str(i) for i in (tokenizer.bos_id, tokenizer.eos_id))
        return ChatTemplate(source, bos_token=bos, eos_token=eos, name=os.path.basename(args.chat_template_file))
    saved = model.header["chat_template"]
    return None if saved is None else ChatTemplate(saved["source"], bos_token=saved["bos_token"],
                                                   eos_token=saved["eos_token"], name=saved["name"])


def _gpu_visible() -> bool:
    """A GPU the PyTorch path would run on by default (NVIDIA's driver lists one, or ROCm's device is there), seen
    without importing PyTorch."""
    nvidia = Path("/proc/driver/nvidia/gpus")
    return (nvidia.is_dir() and any(nvidia.iterdir())) or Path("/dev/kfd").exists()


def _note(line: str) -> None:
    print(line, file=sys.stderr)


def runs_lean(args: argparse.Namespace) -> bool:
    """Whether a command given neither --lean nor --torch runs here: a GGUF file, no flag only the PyTorch path
    takes, no GPU for it to take by default, the kernels not turned off, and a model whose blocks all run on the
    kernels (found when its image is first prepared; a model that cannot is noted once and runs on the PyTorch path,
    as does one whose image could not be made). Where the model cannot be found, the PyTorch path reports it, as it
    always has."""
    if args.torch or torch_only_flags(args) or (args.device is None and _gpu_visible()) or build.variant() == "off":
        return False  # (RUNLM_GGUF_KERNELS=0: no kernels wanted, so plain PyTorch)
    try:
        path = catalog.resolve_model(args.model)
    except RunlmError:
        return False
    if not path.is_file():  # a Hugging Face directory
        return False
    try:
        image_for(path, log=_note)
    except LeanRefusal as exc:
        _note(f"runlm: {exc}; running on the PyTorch path")
        return False
    except (RunlmError, OSError) as exc:
        _note(f"runlm: could not prepare {path.name} to run without PyTorch ({exc}); running on the PyTorch path")
        return False
    return True


COMMANDS = {"generate": (add_generate_arguments, run), "chat": (add_chat_arguments, run_chat),
            "serve": (add_serve_arguments, run_serve)}


def main(argv: Sequence[str]) -> int | None:
    """`runlm generate|chat|serve ...` (argv from the command's name on) here, without PyTorch: its exit status, or
    None where the PyTorch path should run it (--torch, or neither --lean nor --torch and not `runs_lean`)."""
    command = argv[0]
    parser = argparse.ArgumentParser(prog=f"runlm {command}")
    add_arguments, run_command = COMMANDS[command]
    add_arguments(parser)
    args = parser.parse_args(argv[1:])
    if args.torch or (not args.lean and not runs_lean(args)):
        return None
    return exit_status(lambda: run_command(args))


__all__ = ["main", "reply", "run", "run_chat", "run_serve", "runs_lean", "torch_only_flags"]
