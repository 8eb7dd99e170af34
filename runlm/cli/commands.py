"""The `runlm` command: generate, chat, info, pull, serve, bench, simulate. Importing it does not import PyTorch:
a model runs on the runtime runlm.runtime.load picks (the native one for a GGUF file on a CPU), and every command
that answers prompts runs on the one decode loop, runlm.engine."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence

from runlm import catalog, hub
from runlm.cli.args import (
    add_chat_arguments,
    add_generate_arguments,
    add_model_arguments,
    add_serve_arguments,
    chat_loop,
    chat_web,
    exit_status,
    read_template_file,
    sampling_params,
    serve_options,
    speculation_of,
    terminal_safe,
)
from runlm.cluster.simulate import add_arguments as add_simulation_arguments
from runlm.cluster.simulate import run_from_args as run_simulation_from_args
from runlm.engine import Engine, GenerationRequest, ImageInput
from runlm.engine.core import Usage
from runlm.engine.reasoning import ThinkingPlan
from runlm.engine.speculative import Speculation
from runlm.errors import CatalogError, RunlmError
from runlm.pixels import image_to_rgb
from runlm.runner import ServedModel
from runlm.runtime import TORCH_EXTRA, load, require_torch
from runlm.shapes import SHAPES
from runlm.system import cpu_name, meminfo_bytes
from runlm.text import ChatTemplate


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="runlm", description="Run open language models locally.")
    sub = parser.add_subparsers(dest="command", required=True)

    add_generate_arguments(sub.add_parser("generate", help="stream a completion for one prompt"))

    add_chat_arguments(sub.add_parser("chat", help="interactive multi-turn chat"))

    info = sub.add_parser("info", help="family, format, quantization, context, vocabulary")
    add_model_arguments(info)
    info.add_argument("model_arg", nargs="?", default=None, metavar="MODEL")
    info.add_argument("--system", action="store_true",
                      help="this machine instead of a model: CPU, the kernels' instruction set, threads, memory")

    pull = sub.add_parser("pull", help="download a catalog model, or hf.co/<user>/<repo>[:<quant>], into the cache")
    pull.add_argument("name", nargs="?", default=None)
    pull.add_argument("--force", action="store_true", help="a catalog model: download it again")

    sub.add_parser("list", help="list catalog models and whether they are pulled, and models pulled from the Hub")
    rm = sub.add_parser("rm", help="remove a pulled model (a catalog name, or hf.co/<user>/<repo>)")
    rm.add_argument("name")

    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))

    bench = sub.add_parser("bench", help="speed, memory and perplexity side by side with peers")
    add_model_arguments(bench)
    bench.add_argument("--prompt-tokens", type=int, default=512)
    bench.add_argument("--gen-tokens", type=int, default=128)
    bench.add_argument(
        "--vs", action="append", default=[], choices=["llama.cpp", "transformers", "runlm-f32", "runlm-torch"],
        help="peers to measure in the same run beside runlm (the native runtime, what generate runs): runlm-torch, "
             "the PyTorch backend on the same kernels; runlm-f32, its float32 reference",
    )
    bench.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed prefill + decode runs per peer; the best counts (a shared machine's stalls hit runs, not code)",
    )
    bench.add_argument("--ppl-tokens", type=int, default=1024)
    bench.add_argument("--json", default=None, help="also write the results to this JSON file")
    bench.add_argument("--streams", default=None, help="e.g. 1,4,8: aggregate decode tok/s with continuous batching")
    bench.add_argument("--admit-tokens", type=int, default=2000,
                       help="with --streams: the long prompt admitted beside running streams")
    bench.add_argument("--replicas", default=None,
                       help="e.g. 1,2: aggregate tok/s and TTFT through `serve --replicas N` (Ray Serve), the threads "
                            "split between the replicas; --streams N sets the concurrent clients (default 8)")
    bench.add_argument(
        "--prompt-cache", action="store_true", help="time to first token with and without a cached prefix"
    )
    bench.add_argument("--drafts", action="store_true",
                       help="speculative decoding off and on: a copy-heavy request and free text (runlm.bench."
                            "speculative)")
    bench.add_argument("--health", action="store_true",
                       help="/health latency while hostile requests run against `runlm serve` (runlm.bench.health)")
    bench.add_argument(
        "--kernels", action="store_true", help="one matmul per weight type and shape: kernel vs f32 vs torch int4"
    )
    bench.add_argument("--shape", choices=list(SHAPES), default=None,
                       help="instead of -m: a random-weight GGUF at this real model's shape, built once and cached")
    bench.add_argument("--quant", default="Q4_K_M",
                       help="--shape's type: F16, F32, or a llama.cpp type (Q4_K_M, Q8_0, Q4_0...) made by llama.cpp's "
                            "quantizer")
    simulate = sub.add_parser("simulate", help="replay a multi-turn trace against simulated replicas: how "
                                              "routing policies compare at scale")
    add_simulation_arguments(simulate)
    return parser


def runtime_asked(args: argparse.Namespace) -> str:
    """The runtime the flags ask for: --torch, --native (or --lean), else auto."""
    if getattr(args, "torch", False):
        return "torch"
    return "native" if getattr(args, "native", False) else "auto"


def _note(line: str) -> None:
    print(line, file=sys.stderr)


def _load(args: argparse.Namespace, model: str | None = None):
    name = model if model is not None else args.model
    template_file = getattr(args, "chat_template_file", None)
    template = read_template_file(template_file) if template_file else None  # fail before the load
    if getattr(args, "max_tokens", None) is not None and args.max_tokens < 1:
        raise RunlmError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.ctx is not None and args.ctx < 1:
        raise RunlmError(f"--ctx must be positive, got {args.ctx}")
    loaded = load(
        name, runtime=runtime_asked(args), dtype=args.dtype, max_context=args.ctx,
        mmproj=getattr(args, "mmproj", None), device=args.device, swa_full=args.swa_full, kv_type=args.kv_type,
        threads=args.threads, images=getattr(args, "image", None) is not None, note=_note,
    )  # fmt: skip
    if template is not None:
        tok = loaded.tokenizer
        bos, eos = (None if i is None else tok.token_str(i) for i in (tok.bos_id, tok.eos_id))
        name = os.path.basename(template_file)
        loaded.chat_template = ChatTemplate(template, bos_token=bos, eos_token=eos, name=name)
    return loaded


def cmd_generate(args: argparse.Namespace) -> int:
    image = ImageInput(*image_to_rgb(args.image)) if args.image is not None else None  # fail before the load
    loaded = _load(args)
    prompt = args.prompt
    marker = loaded.runner.image_marker()
    if image is not None and marker is None:
        raise RunlmError(f"{loaded.path.name}: this {loaded.family} model has no vision tower and cannot take images")
    if image is not None and marker not in prompt:
        prompt = marker + prompt  # an image with no marker goes before the text, inside the user turn
    thinking = ThinkingPlan()  # a raw prompt's reply is printed as it comes
    if args.raw or loaded.chat_template is None:
        text = prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        text = loaded.chat_template.render(messages, **template_switches(args))
        thinking = ThinkingPlan.for_prompt("auto", loaded.chat_template.source, text)
    _stream_reply(_engine(loaded, args), text, args, image, thinking)
    return 0


def template_switches(args: argparse.Namespace) -> dict:
    """The chat template's switches the command line set: `--think` / `--no-think` as enable_thinking."""
    think = getattr(args, "think", None)
    return {} if think is None else {"enable_thinking": think}


def _engine(loaded: ServedModel, args: argparse.Namespace) -> Engine:
    return Engine(loaded.runner, loaded.tokenizer, context_length=loaded.context_length,
                  speculation=speculation_of(args, loaded))


# how a reply's thinking shows on a terminal: dimmed, then the style reset for the answer
THINKING_STYLE, ANSWER_STYLE = "\x1b[2m", "\x1b[0m"


def _stream_reply(engine, text: str, args: argparse.Namespace, image=None,
                  thinking: ThinkingPlan = ThinkingPlan()) -> str:
    """Print the reply to a rendered prompt as it is produced, its thinking (split off as `thinking` says) dimmed
    on a terminal, or left out with --hide-thinking; return the answer's text."""
    if args.max_tokens < 1:
        raise RunlmError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    request = GenerationRequest(prompt_ids=[], max_tokens=args.max_tokens, sampling=sampling_params(args))
    if image is not None:
        engine.with_image(request, text, image)
    else:
        request.prompt_ids = engine.tokenizer.encode_prompt(text)
    answer: list[str] = []
    terminal = sys.stdout.isatty()
    shown = terminal_safe if terminal else str
    hide = getattr(args, "hide_thinking", False)
    splitter = thinking.splitter()
    state = {"thought": False, "answered": False}

    def write(reasoning: str, content: str) -> None:
        if reasoning and not hide:
            if not state["thought"]:
                sys.stdout.write(THINKING_STYLE if terminal else "")
            state["thought"] = True
            sys.stdout.write(shown(reasoning))
        if content:
            if state["thought"] and not state["answered"]:  # the answer a paragraph after the thinking
                sys.stdout.write((ANSWER_STYLE if terminal else "") + "\n\n")
            state["answered"] = True
            answer.append(content)
            sys.stdout.write(shown(content))
        sys.stdout.flush()

    for record in engine.generate(request):
        if record.text:
            write(*splitter.push(record.text))
        if record.usage is not None and getattr(args, "stats", False):
            print_stats(record.usage)
    write(*splitter.finish())
    sys.stdout.write(ANSWER_STYLE if terminal and state["thought"] and not state["answered"] else "")
    sys.stdout.write("\n")
    return "".join(answer)


def print_stats(usage: Usage) -> None:
    """One line on stderr: the prompt and decode speeds, and how many drafted tokens the model kept."""
    prompt_run = usage.prompt_tokens - usage.cached_tokens
    prefill = prompt_run / usage.prefill_s if usage.prefill_s > 0 else 0.0
    drafts = (f", drafts kept {usage.accepted_tokens}/{usage.draft_tokens} "
              f"({usage.accepted_tokens / usage.draft_tokens:.0%})" if usage.draft_tokens else ", no drafts")
    print(f"\nrunlm: prompt {usage.prompt_tokens} tokens ({usage.cached_tokens} cached) at {prefill:.1f} tok/s, "
          f"{usage.completion_tokens} generated at {usage.decode_tokens_per_s:.1f} tok/s{drafts}", file=sys.stderr)


def cmd_chat(args: argparse.Namespace) -> int:
    if args.web:
        return _chat_web(args)
    loaded = _load(args)
    if loaded.chat_template is None:
        raise RunlmError(f"{loaded.path}: the model has no chat template; use `runlm generate --raw`")
    engine = _engine(loaded, args)  # its prompt cache makes each turn prefill only the new text
    print(f"runlm chat: {loaded.path.name} ({loaded.family}, {loaded.runtime} runtime). Empty line or Ctrl-D to quit.",
          file=sys.stderr)
    def answer(messages: list[dict]) -> str:
        prompt = loaded.chat_template.render(messages, **template_switches(args))
        return _stream_reply(engine, prompt, args, thinking=ThinkingPlan.for_prompt(
            "auto", loaded.chat_template.source, prompt))

    return chat_loop(args.system, answer)


def _chat_web(args: argparse.Namespace) -> int:
    return chat_web(args, cmd_serve)


def _gib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def system_rows(threads: int | None = None) -> list[tuple[str, str]]:
    """What decides runlm's speed here: the CPU, the kernels' variant (the one the native runtime loads for this
    CPU), threads. No PyTorch: its version is read from the installed package's metadata."""
    from runlm.native import build, library

    try:
        isa = library.isa()
    except RunlmError as exc:
        isa = None
        off = str(exc)
    rows = [
        ("cpu", cpu_name()),
        ("cores", str(os.cpu_count())),
        ("threads", str(threads or os.environ.get("OMP_NUM_THREADS") or os.cpu_count())),
        ("kernels", isa or f"off ({off})"),
    ]
    if isa is not None:
        rows.append(("kernel flags", " ".join(build.variant_cflags())))
        rows.append(("AMX tiles", "used for K-quant and Q8_0 prefill" if "amx" in isa else build.amx_absence()))
        rows.append(("decode walk", build.decode_walk_summary(isa)))
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = f"not installed (the PyTorch backend: {TORCH_EXTRA})"
    rows += [
        ("memory", _gib(meminfo_bytes("MemTotal")) + " total, " + _gib(meminfo_bytes("MemAvailable")) + " available"),
        ("torch", torch_version),
    ]
    return rows


def cmd_info(args: argparse.Namespace) -> int:
    if args.system:
        if args.model_arg or args.model:
            print("runlm: error: info --system describes this machine; give it no model", file=sys.stderr)
            return 2
        for key, value in system_rows(args.threads):
            print(f"{key:>16}: {value}")
        return 0
    name = args.model_arg or args.model
    memory = memory_row(catalog.resolve_model(name), args.ctx)
    if memory is not None:
        print(f"{'memory':>16}: {memory[0]}")
        if not memory[1]:
            return 0  # told before loading: a model that does not fit is not loaded to describe it
    loaded = _load(args, name)
    cfg = loaded.config
    rows = [
        ("path", str(loaded.path)),
        ("family", loaded.family),
        ("format", loaded.format),
        ("quantization", loaded.quantization),
        ("context length", str(cfg.max_position)),
        ("vocabulary", str(cfg.vocab_size)),
        ("layers", str(cfg.num_layers)),
        ("hidden size", str(cfg.hidden_size)),
        ("heads (q / kv)", _heads_row(cfg)),
        *_family_rows(loaded),
        ("chat template", "yes" if loaded.chat_template is not None else "no"),
        ("runtime", loaded.runtime),
        ("kernels", _kernels_row(loaded.runtime)),
    ]
    for key, value in rows:
        print(f"{key:>16}: {value}")
    return 0


def _heads_row(cfg) -> str:
    """Query and KV heads and their size; sliding-window layers' own where they differ (Gemma 4)."""
    heads = f"{cfg.num_heads} / {cfg.num_kv_heads} of {cfg.head_dim}"
    if cfg.sliding_head_dim or cfg.sliding_kv_heads:
        sliding = cfg.sliding_kv_heads or cfg.num_kv_heads, cfg.sliding_head_dim or cfg.head_dim
        heads += f" (sliding-window layers: {cfg.num_heads} / {sliding[0]} of {sliding[1]})"
    return heads


def memory_row(path, ctx: int | None) -> tuple[str, bool] | None:
    """What a GGUF model needs in memory, read from its header before anything loads: its weights (the file, mapped
    and read in place) and its KV cache at the context (f16, sliding-window layers holding their window), against
    the memory available now; and whether it fits. None for a Hugging Face directory."""
    from runlm.formats.gguf import GGUFFile, weights_bytes_per_token
    from runlm.native.model import model_config

    if not path.is_file():
        return None
    gguf = GGUFFile(path)
    _, cfg = model_config(gguf)
    positions = min(ctx or cfg.max_position, cfg.max_position)
    kv = 0
    for layer in range(cfg.num_layers):
        per_position = 2 * cfg.layer_kv_heads(layer) * cfg.layer_head_dim(layer) * 2  # a key and a value row, f16
        kv += per_position * (min(positions, cfg.sliding_window) if cfg.is_sliding(layer) else positions)
    weights = sum(part.stat().st_size for part in gguf.paths)
    available = meminfo_bytes("MemAvailable")
    need = weights + kv
    verdict = "" if available is None else (f" of {_size(available)} available: fits" if need <= available else
                                            f" of {_size(available)} available: does not fit")
    experts = ""
    if cfg.num_experts:
        experts = (f"; a token reads {_size(weights_bytes_per_token(gguf))} of the weights ({cfg.experts_per_token} "
                   f"of {cfg.num_experts} experts)")
    return (f"{_size(need)} (weights {_size(weights)}, mapped from the file, + KV cache {_size(kv)} at {positions} "
            f"positions){verdict}{experts}", available is None or need <= available)


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes < 1e9 else f"{nbytes / 1e9:.2f} GB"


def _family_rows(loaded: ServedModel) -> list[tuple[str, str]]:
    from runlm import families

    spec = next((s for s in families.specs().values() if s.name == loaded.family), None)
    return [] if spec is None else spec.describe(loaded.config)


def _kernels_row(runtime: str) -> str:
    if runtime == "native":
        from runlm.native import library

        return library.isa()
    from runlm.pytorch import kernels

    return kernels.isa() or f"off ({kernels.unavailable_reason() or 'disabled'}): plain PyTorch"


def cmd_pull(args: argparse.Namespace) -> int:
    name = args.name or catalog.DEFAULT_MODEL
    ref = hub.parse_ref(name)
    if ref is not None:
        model, projector = hub.pull(ref, progress=True)
        print(model if projector is None else f"{model}\n{projector}")
        return 0
    path = catalog.pull(name, progress=True, force=args.force)
    print(path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from runlm import families

    for model in catalog.CATALOG.values():
        mark = "pulled" if catalog.is_pulled(model.name) else "-"
        default = " (default)" if model.name == catalog.DEFAULT_MODEL else ""
        print(f"{model.name:<16} {mark:<7} {model.description}{default}")
    for name, _, size in hub.pulled():
        print(f"{name}  {_size(size)}")
    print("\nfamilies runlm runs, by the GGUF architecture that names them (any such file: a path, the Hub, a "
          "models dir):")
    for spec in families.specs().values():
        if spec.gguf_architectures:
            print(f"  {spec.name:<10} {', '.join(spec.gguf_architectures)}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    ref = hub.parse_ref(args.name)
    if ref is not None:
        for path in hub.remove(ref):
            print(f"removed {path}")
        return 0
    path = catalog.model_path(args.name)
    if not path.is_file():
        raise CatalogError(f"{args.name}: not pulled")
    path.unlink()
    print(f"removed {path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from runlm.server import serve  # optional: the [server] extra

    server_options = serve_options(args)
    if args.models_dir is not None:
        return serve_models_dir(args, server_options)
    for flag, value in (("--max-loaded", args.max_loaded), ("--keep-alive", args.keep_alive)):
        if value is not None:
            raise RunlmError(f"{flag} applies with --models-dir (a server of one model keeps it loaded)")
    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None:
        return serve_on_ray(args, server_options)
    loaded = _load(args)
    serve(loaded, host=args.host, port=args.port, prompt_cache_mb=args.prompt_cache_mb, max_queue=args.max_queue,
          max_batch=args.parallel, kv_budget_mb=args.kv_budget_mb, speculation=speculation_of(args, loaded),
          **server_options)
    return 0


def serve_models_dir(args: argparse.Namespace, server_options: dict) -> int:
    """`runlm serve --models-dir DIR`: every model of DIR and of the cache, each loaded (with the same flags) on the
    first request that names it; -m, where given, names the one loaded at the start."""
    from runlm.server import serve
    from runlm.server.library import ModelLibrary
    from runlm.server.pool import parse_keep_alive

    one_model = {"--replicas": args.replicas or args.min_replicas or args.max_replicas, "--mmproj": args.mmproj,
                 "--draft-model": args.draft_model, "--chat-template-file": args.chat_template_file}
    for flag, value in one_model.items():
        if value is not None:
            raise RunlmError(f"{flag} cannot be combined with --models-dir")
    if args.max_loaded is not None and args.max_loaded < 1:
        raise RunlmError(f"--max-loaded must be at least 1, got {args.max_loaded}")
    if args.keep_alive is not None:
        parse_keep_alive(args.keep_alive, "--keep-alive")
    library = ModelLibrary(args.models_dir)  # a wrong directory fails before any load
    preloaded = None
    if args.model is not None:
        source = library.find(args.model)
        preloaded = _load(args, source.ref if source is not None else args.model)
    options = {"max_loaded": args.max_loaded} if args.max_loaded is not None else {}
    serve(preloaded, host=args.host, port=args.port, prompt_cache_mb=args.prompt_cache_mb, max_queue=args.max_queue,
          max_batch=args.parallel, kv_budget_mb=args.kv_budget_mb,
          speculation=Speculation(args.speculative or "ngram", args.draft_max), models_dir=library.directory,
          loader=lambda ref: _load(args, ref), keep_alive=args.keep_alive, **options, **server_options)
    return 0


def serve_on_ray(args: argparse.Namespace, server_options: dict) -> int:
    """`runlm serve --replicas N`: the same server, its model half replicated on Ray Serve."""
    from runlm.cluster.deploy import ClusterOptions, ReplicaOptions, serve_replicas

    if args.device not in (None, "cpu"):
        raise RunlmError("--replicas runs on CPUs here; --device is not supported with it yet")
    if args.draft_model is not None or args.speculative == "draft":
        raise RunlmError("--replicas drafts by prompt lookup only; --draft-model is not supported with it yet")
    replica = ReplicaOptions(model=args.model, dtype=args.dtype, ctx=args.ctx, swa_full=args.swa_full,
                             kv_type=args.kv_type, mmproj=args.mmproj, prompt_cache_mb=args.prompt_cache_mb,
                             runtime=runtime_asked(args),
                             max_batch=args.parallel, max_queue=args.max_queue, kv_budget_mb=args.kv_budget_mb,
                             speculation=Speculation(args.speculative or "ngram", args.draft_max))
    cluster = ClusterOptions(replicas=args.replicas if args.replicas is not None else args.min_replicas or 1,
                             threads_per_replica=args.threads_per_replica, ray_address=args.ray_address,
                             insecure_ray=args.insecure_ray,
                             policy=args.routing, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                             target_ongoing_requests=args.target_ongoing_requests, host=args.host, port=args.port)
    serve_replicas(replica, cluster, server_options)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    require_torch("runlm bench (its peers and the random-weight shapes)")
    from runlm.bench import run_bench

    return run_bench(args)


COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "info": cmd_info,
    "pull": cmd_pull,
    "list": cmd_list,
    "rm": cmd_rm,
    "serve": cmd_serve,
    "bench": cmd_bench,
    "simulate": run_simulation_from_args,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(lambda: COMMANDS[args.command](args))

