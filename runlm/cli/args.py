"""The command line's shared arguments (no PyTorch here: the CLI imports it only for a model that needs it)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
import webbrowser
from collections.abc import Callable

from runlm.engine.reasoning import REASONING_FORMATS
from runlm.engine.speculative import DEFAULT_DRAFT_MAX, SPECULATIVE_MODES, Speculation
from runlm.errors import RunlmError, TokenizerError
from runlm.runner import ServedModel
from runlm.sampling import SamplingParams

# What a served request that names no max_tokens may generate: one request without a limit would otherwise hold a
# slot, and its KV budget, to the context's end (llama-server's -n and vLLM's defaults bound it too).
DEFAULT_SERVE_MAX_TOKENS = 2048


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", default=None,
                        help="catalog name, path (GGUF file or HF directory) or hf.co/<user>/<repo>[:<quant>]")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "f32", "bf16"],
        help="auto: GGUF weights kept as stored, run by runlm's kernels; f32: the float32 reference",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--ctx", "--ctx-size", type=int, default=None,
                        help="context length: no prompt + reply runs past it (default: the model's)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when PyTorch sees a GPU)")
    parser.add_argument("--chat-template-file", default=None, metavar="FILE",
                        help="a Jinja chat template to use instead of the model's own (or for a model without one)")
    parser.add_argument(
        "--swa-full", action="store_true",
        help="keep every position in sliding-window layers' caches (more memory; prompt-cache reuse at any length)",
    )
    parser.add_argument("--speculative", default=None, choices=SPECULATIVE_MODES,
                        help="speculative decoding (replies are the same, faster where drafts hold): ngram (the "
                             "default) drafts what followed the context's last tokens where they occurred before; "
                             "draft, the default with --draft-model, drafts with a small model; off")
    parser.add_argument("--draft-model", default=None, metavar="MODEL",
                        help="a small GGUF model with the same tokenizer that drafts tokens (native runtime)")
    parser.add_argument("--draft-max", type=int, default=DEFAULT_DRAFT_MAX,
                        help=f"most tokens drafted a step (default {DEFAULT_DRAFT_MAX})")
    parser.add_argument("--kv-type", default="auto", choices=["auto", "f32", "f16", "q8_0"],
                        help="KV cache element type (auto: f16 for quantized GGUF weights on the default path, "
                             "else as --dtype; q8_0: 8-bit blocks, 17/32 of f16's memory, default path only)")


def read_template_file(path: str) -> str:
    """--chat-template-file's text, read before the model loads (a wrong path fails at once)."""
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"--chat-template-file {path}: {getattr(exc, 'strerror', None) or exc}") from None


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def speculation_of(args: argparse.Namespace, target: ServedModel) -> Speculation:
    """--speculative, --draft-max and --draft-model (loaded here on the native runtime, its tokenizer checked
    against the model's, token by token)."""
    mode = args.speculative or ("draft" if args.draft_model else "ngram")
    if args.draft_model is None or mode != "draft":
        return Speculation(mode, args.draft_max)
    from runlm.runtime import load

    draft = load(args.draft_model, runtime="native", threads=args.threads, max_context=args.ctx)
    ours, theirs = target.tokenizer, draft.tokenizer
    if ours.vocab_size != theirs.vocab_size or any(
            ours.token_to_bytes(i) != theirs.token_to_bytes(i) for i in range(ours.vocab_size)):
        raise RunlmError(f"--draft-model {args.draft_model}: its tokenizer is not the model's (a draft model must "
                         "share the model's vocabulary)")
    return Speculation(mode, args.draft_max, draft.runner)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as the sampler both paths share takes them."""
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--stats", action="store_true",
                     help="print the prompt and decode speeds and the drafts kept, on stderr")
    gen.add_argument("--system", default=None, help="system prompt (chat models)")
    gen.add_argument("--hide-thinking", action="store_true", help="print only the answer, not the thinking before it")
    gen.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                     help="switch the model's thinking on or off (the chat template's enable_thinking; default: the "
                          "template's own choice)")
    gen.add_argument("--image", default=None, help="an image file (PNG, JPEG...) for vision models; greedy decoding")
    gen.add_argument("--mmproj", default=None, help="llama.cpp vision projector GGUF for a GGUF model")
    _add_path_choice(gen)
    gen.add_argument("prompt")


def add_chat_arguments(chat: argparse.ArgumentParser) -> None:
    add_model_arguments(chat)
    add_sampling_arguments(chat)
    chat.add_argument("--system", default=None)
    chat.add_argument("--hide-thinking", action="store_true", help="print only the answers, not the thinking")
    chat.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                      help="switch the model's thinking on or off (default: the chat template's own choice)")
    chat.add_argument("--web", action="store_true", help="serve the chat page and open it in a browser")
    chat.add_argument("--port", type=int, default=8000)
    _add_path_choice(chat)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require this bearer token, or one of several comma-separated (better: RUNLM_API_KEY "
                            "or --api-keys-file, a flag shows in ps); each key has its own prompt cache")
    serve.add_argument("--max-tokens", type=int, default=DEFAULT_SERVE_MAX_TOKENS,
                       help=f"max_tokens of requests that set none, each of `n` / `best_of` (default "
                            f"{DEFAULT_SERVE_MAX_TOKENS}; a request may ask for more, up to the context)")
    serve.add_argument("--api-keys-file", default=None, help="API keys, one per line ('#' comments)")
    serve.add_argument("--shared-prompt-cache", action="store_true",
                       help="let every API key reuse every other key's cached prompts (they can then probe them)")
    serve.add_argument("--prompt-cache-mb", type=int, default=256)
    serve.add_argument("--max-queue", type=int, default=16)
    serve.add_argument("--parallel", type=int, default=8, help="sequences decoded together (continuous batching)")
    serve.add_argument("--kv-budget-mb", type=float, default=None,
                       help="bound on the KV cache of all requests in flight (default: half the memory available "
                            "after the load, per replica with --replicas; 0: no bound)")
    serve.add_argument("--mmproj", default=None, help="llama.cpp vision projector GGUF for a GGUF model")
    serve.add_argument("--allow-remote-images", action="store_true", help="fetch http(s) image_url parts")
    serve.add_argument("--allow-private-image-urls", action="store_true",
                       help="with --allow-remote-images: also fetch from loopback, private and link-local addresses")
    serve.add_argument("--allowed-hosts", action="append", default=[], metavar="HOSTS",
                       help="more host names the server answers to, comma-separated (default: loopback names and "
                            "IP addresses; '*' allows any; '.example.com' a domain and its subdomains)")
    serve.add_argument("--api-docs", action="store_true", help="serve /docs, /redoc and /openapi.json (CDN assets)")
    serve.add_argument("--special-tokens-in-content", action="store_true",
                       help="special-token strings in message text become control tokens (default: text; only "
                            "the chat template's own markers are control tokens)")
    serve.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="auto",
                       help="give a reply's thinking apart from its answer (reasoning_content, Anthropic thinking "
                            "blocks, Ollama's thinking): auto: <think> or gpt-oss's harmony channels, where the "
                            "chat template writes them; none: leave it in the answer; 'deepseek' is llama-server's "
                            "name for think")
    serve.add_argument("--reasoning-budget", type=int, default=-1,
                       help="tokens a reply may think before it is made to close its <think> phase and answer "
                            "(default -1: no bound; 0: the template's thinking off); a request's reasoning_budget or "
                            "Anthropic thinking.budget_tokens wins")
    serve.add_argument("--pooling", choices=("mean", "last"), default=None,
                       help="how embeddings pool token states (default: as the model declares, else mean)")
    serve.add_argument("--reranker", action=argparse.BooleanOptionalAction, default=None,
                       help="score /v1/rerank with the model as a Qwen3-Reranker (P(yes)); --no-reranker: by "
                            "embedding similarity (default: a reranker where the model's name or GGUF says so)")
    models = serve.add_argument_group("many models, each loaded on the first request that names it")
    models.add_argument("--models-dir", default=None, metavar="DIR",
                        help="serve every GGUF file in DIR (named by its file name without .gguf) and every pulled "
                             "model (named as `runlm list` shows it); -m names one to load at the start")
    models.add_argument("--max-loaded", type=int, default=None, metavar="N",
                        help="with --models-dir: models loaded at once; to load another, the least recently used "
                             "one that no request holds is unloaded (default 1: each model's KV budget is half the "
                             "memory available at its load)")
    models.add_argument("--keep-alive", default=None, metavar="DURATION",
                        help="with --models-dir: how long a model stays loaded after its last request (\"5m\", "
                             "\"1h\", seconds; negative: for ever; 0: unload after each request; default 5m); a "
                             "request's keep_alive (Ollama's field) wins")
    cluster = serve.add_argument_group("replicas on Ray Serve (pip install 'runlm[cluster]')")
    cluster.add_argument("--replicas", type=int, default=None,
                         help="serve N model replicas behind one endpoint on Ray Serve (default: one process, no Ray)")
    cluster.add_argument("--threads-per-replica", type=int, default=1, help="CPU threads (and Ray CPUs) per replica")
    cluster.add_argument("--ray-address", default=None,
                         help="join this Ray cluster ('auto', 'host:6379'); it must run with Ray's token auth "
                              "(RAY_AUTH_MODE=token); default: start a local Ray on loopback")
    cluster.add_argument("--insecure-ray", action="store_true",
                         help="join a --ray-address cluster that answers without a token")
    cluster.add_argument("--routing", choices=("prefix-affinity", "power-of-two", "round-robin"),
                         default="prefix-affinity", help="how requests pick a replica")
    cluster.add_argument("--min-replicas", type=int, default=None, help="autoscale: at least this many replicas")
    cluster.add_argument("--max-replicas", type=int, default=None, help="autoscale: at most this many replicas")
    cluster.add_argument("--target-ongoing-requests", type=float, default=4.0,
                         help="autoscale: requests per replica the autoscaler aims for")
    _add_path_choice(serve)


def serve_options(args: argparse.Namespace) -> dict:
    """The server's options from `runlm serve`'s flags."""
    if args.max_tokens is not None and args.max_tokens < 1:
        raise RunlmError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return dict(
        api_key=serve_keys(args),
        shared_prompt_cache=args.shared_prompt_cache,
        default_max_tokens=args.max_tokens,
        allow_remote_images=args.allow_remote_images,
        allow_private_image_urls=args.allow_private_image_urls,
        pooling=args.pooling,
        reranker=args.reranker,
        allowed_hosts=[h for value in args.allowed_hosts for h in value.split(",") if h.strip()],
        api_docs=args.api_docs,
        special_tokens_in_content=args.special_tokens_in_content,
        reasoning_format=args.reasoning_format,
        reasoning_budget=args.reasoning_budget,
    )


def serve_keys(args: argparse.Namespace) -> list[str]:
    """--api-key, the keys file and RUNLM_API_KEY together (any of them may hold several keys)."""
    from runlm.server.middleware import api_keys_from, read_api_keys_file  # optional: the [server] extra

    keys = api_keys_from(args.api_key) + api_keys_from(os.environ.get("RUNLM_API_KEY"))
    return keys + (read_api_keys_file(args.api_keys_file) if args.api_keys_file else [])


def _add_path_choice(parser: argparse.ArgumentParser) -> None:
    path = parser.add_mutually_exclusive_group()
    path.add_argument("--native", "--lean", dest="native", action="store_true",
                      help="only the native runtime (no PyTorch), or an error saying why not (default: it where the "
                           "model and flags allow, else the PyTorch backend)")
    path.add_argument("--torch", action="store_true",
                      help="the PyTorch backend (default: the native runtime where the model and flags allow)")


# C0 controls but tab, newline and carriage return, DEL, and C1 controls: what starts or ends an ANSI / OSC
# escape sequence (colours, cursor moves, window titles, clipboard writes, hyperlinks), rings or backspaces.
_TERMINAL_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F,
                                                   *range(0x80, 0xA0)]}


def terminal_safe(text: str) -> str:
    """`text` with every terminal control character written out (ESC as \\x1b): model output and names read
    from model files reach the terminal as text, never as escape sequences. Per character, so a sequence
    split across streamed pieces is caught too."""
    return text.translate(_TERMINAL_CONTROLS)


def exit_status(command: Callable[[], int]) -> int:
    """Run a command: its status, or for a runlm error one line on stderr and 1 (never a traceback); Ctrl-C 130."""
    try:
        return command()
    except RunlmError as exc:
        print(f"runlm: error: {terminal_safe(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`runlm generate ... | head`): stop quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush of stdout at exit would raise again
        return 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


def chat_loop(system: str | None, answer: Callable[[list[dict]], str]) -> int:
    """The chat REPL both chats run: a user line per turn (an empty line or end of input ends it), `answer` prints
    the reply to the conversation so far and returns its text."""
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        messages.append({"role": "assistant", "content": answer(messages)})


def chat_web(args: argparse.Namespace, serve: Callable[[argparse.Namespace], int]) -> int:
    """`runlm chat --web`: `serve` the chat page on loopback, and open it in a
    browser once the server answers (after the load)."""
    url = f"http://127.0.0.1:{args.port}/"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # fail now, not after loading the model
        try:
            probe.bind(("127.0.0.1", args.port))
        except OSError as exc:
            raise RunlmError(f"port {args.port} is not free ({exc.strerror}); choose another with --port") from None

    def open_when_listening() -> None:
        while True:
            try:
                socket.create_connection(("127.0.0.1", args.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        print(f"runlm: chat page at {url}", file=sys.stderr)
        webbrowser.open(url)

    threading.Thread(target=open_when_listening, name="runlm-open-browser", daemon=True).start()
    serve_args = argparse.Namespace(**{
        **vars(args), "host": "127.0.0.1", "api_key": None, "api_keys_file": None, "shared_prompt_cache": False,
        "prompt_cache_mb": 256, "max_queue": 16, "parallel": 8,
        "mmproj": None, "allow_remote_images": False, "allow_private_image_urls": False, "pooling": None,
        "reranker": None,
        "allowed_hosts": [], "api_docs": False, "special_tokens_in_content": False, "kv_budget_mb": None,
        "reasoning_format": "auto", "reasoning_budget": -1,
        "replicas": None, "min_replicas": None, "max_replicas": None,  # one process: the page is one user's
        "models_dir": None, "max_loaded": None, "keep_alive": None,
        "max_tokens": None,  # the page's requests run to their end unless they say otherwise
        "web": False,  # what is served is a server
    })
    return serve(serve_args)
