"""The `runlm` command, run as a user runs it: a subprocess on the real SmolLM2."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from reference.tiny import build_qwen3_embedding
from server_harness import serve_cli

from runlm import load
from runlm.cli import commands as cli
from runlm.engine import StreamRecord
from runlm.engine.embeddings import embed, embedding_ids
from runlm.engine.reasoning import ThinkingPlan
from runlm.native import build
from runlm.pytorch import kernels


def runlm(*args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runlm", *args], input=stdin, capture_output=True, text=True,
                          timeout=300, env=None if env is None else {**os.environ, **env})


def test_info(smollm2_gguf):
    out = runlm("info", "smollm2-135m")
    assert out.returncode == 0, out.stderr
    assert "family: llama32" in out.stdout
    assert "quantization: Q4_1" in out.stdout
    assert "context length: 8192" in out.stdout
    assert "vocabulary: 49152" in out.stdout
    assert f"kernels: {kernels.isa()}" in out.stdout if kernels.available() else "kernels: off" in out.stdout


def test_list_names_the_catalog_and_every_family_by_its_gguf_architecture(capsys):
    from runlm import families

    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "(default)" in out
    rows = out.split("families runlm runs", 1)[1].splitlines()[1:]
    listed = {line.split()[0]: line.split(None, 1)[1] for line in rows}
    for spec in families.specs().values():
        if spec.gguf_architectures:
            assert listed[spec.name] == ", ".join(spec.gguf_architectures)
    assert listed["gemma4"] == "gemma4"


def test_info_says_whether_a_model_fits_before_loading_it(smollm2_gguf, monkeypatch, capsys):
    out = runlm("info", "smollm2-135m", "--ctx", "1024")
    memory = next(line for line in out.stdout.splitlines() if line.strip().startswith("memory:"))
    # SmolLM2: 30 layers x 3 KV heads x 64 x (key + value) x 2 bytes x 1024 positions
    assert "KV cache 23.6 MB at 1024 positions" in memory and memory.endswith("fits"), memory
    assert f"weights {smollm2_gguf.stat().st_size / 1e6:.1f} MB" in memory
    monkeypatch.setattr(cli, "meminfo_bytes", lambda field: 50_000_000)  # 50 MB available
    monkeypatch.setattr(cli, "_load", lambda *a, **k: pytest.fail("loaded a model that does not fit"))
    assert cli.main(["info", str(smollm2_gguf)]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_info_system_names_the_kernels_dispatch():
    out = runlm("info", "--system")
    assert out.returncode == 0, out.stderr
    fields = dict(line.strip().split(": ", 1) for line in out.stdout.splitlines())
    if kernels.available():
        assert fields["kernels"] == kernels.isa()
    else:
        assert fields["kernels"].startswith("off")
    assert int(fields["cores"]) == os.cpu_count()
    if kernels.available():
        assert fields["kernel flags"] == " ".join(build.variant_cflags())
        assert ("amx" in fields["kernels"]) == fields["AMX tiles"].startswith("used")
        if kernels.decode_walk():  # the interleaved kernels' walk: the build's and CPU's, unless the environment says
            assert fields["decode walk"].split()[0] == kernels.decode_walk()
        burst = runlm("info", "--system", env={kernels.WALK_ENV_VAR: "burst"})
        assert "decode walk: burst (" in burst.stdout or "decode walk: none" in burst.stdout, burst.stdout
    refused = runlm("info", "--system", "smollm2-135m")
    assert refused.returncode != 0 and refused.stderr.count("\n") == 1 and "no model" in refused.stderr


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """`runlm ... | head`: once nobody reads stdout, the command stops with the shell's SIGPIPE status, no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written: deterministic EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "runlm", "info", "--system"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("dtype, kv_type, path", [("auto", "auto", []), ("auto", "auto", ["--torch"]),
                                               ("f32", "auto", []), ("auto", "q8_0", [])])
def test_generate_streams_the_greedy_answer(smollm2_gguf, dtype, kv_type, path):
    """By default (no --lean, no --torch) in the process without PyTorch, and with --torch on the PyTorch path:
    both answer what the library's runner does (--dtype f32 always takes the PyTorch path)."""
    if kv_type == "q8_0" and not kernels.available():
        pytest.skip("a q8_0 KV cache needs runlm's C++ kernels")
    prompt = "What is the capital of France?"
    out = runlm("generate", "-m", str(smollm2_gguf), "--dtype", dtype, "--kv-type", kv_type, "--max-tokens", "12",
                *path, prompt)
    assert out.returncode == 0, out.stderr
    loaded = load(smollm2_gguf, dtype=dtype, kv_type=kv_type)
    ids = loaded.tokenizer.encode_prompt(loaded.chat_template.render([{"role": "user", "content": prompt}]))
    greedy = loaded.runner.generate(ids, 12)
    stop = next((i for i, t in enumerate(greedy) if t in loaded.tokenizer.stop_ids), len(greedy))
    assert out.stdout.strip() == loaded.tokenizer.decode(greedy[:stop]).strip()
    if dtype == "f32":
        # The f32 reference answers right. The packed path, like llama.cpp on this Q4_1 file, starts with "L"
        # (a 0.08-logit near-tie with "The" in f32) and wanders off.
        assert "Paris" in out.stdout


def test_generate_raw_with_seed_is_reproducible(smollm2_gguf):
    args = ("generate", "-m", str(smollm2_gguf), "--raw", "--max-tokens", "8", "--temperature", "0.9", "--seed", "7")
    first, second = runlm(*args, "Once upon a time"), runlm(*args, "Once upon a time")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.strip()


def test_chat_template_file_replaces_the_models_template(smollm2_gguf, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    out = runlm("generate", "-m", str(smollm2_gguf), "--chat-template-file", str(template), "--max-tokens", "6",
                "Hello")
    assert out.returncode == 0, out.stderr
    loaded = load(smollm2_gguf)
    greedy = loaded.runner.generate(loaded.tokenizer.encode_prompt("user: Hello\nassistant:"), 6)
    stop = next((i for i, t in enumerate(greedy) if t in loaded.tokenizer.stop_ids), len(greedy))
    assert out.stdout.strip() == loaded.tokenizer.decode(greedy[:stop]).strip()


@pytest.mark.parametrize("path", [[], ["--torch"]])
def test_chat_repl_answers_and_quits(smollm2_gguf, path):
    out = runlm("chat", "-m", str(smollm2_gguf), "--max-tokens", "8", *path, stdin="Say hello.\n\n")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


@pytest.mark.parametrize(
    "args, message",
    [
        (("generate", "-m", "/nonexistent/model.gguf", "hi"), "no such file"),
        (("info", "no-such-model"), "no such file"),
        (("pull", "no-such-model"), "unknown catalog model"),
        (("generate", "-m", "smollm2-135m", "--chat-template-file", "/nonexistent/t.jinja", "hi"),
         "--chat-template-file /nonexistent/t.jinja: No such file"),
    ],
)
def test_errors_are_one_line_and_nonzero(args, message):
    out = runlm(*args)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runlm: error:") and message in lines[0]


def test_negative_max_tokens_is_rejected(smollm2_gguf):
    out = runlm("generate", "-m", str(smollm2_gguf), "--max-tokens", "-3", "hi")
    assert out.returncode != 0
    assert "max" in out.stderr.lower()


def test_serve_pooling_flag_sets_how_embeddings_pool(tmp_path):
    """`runlm serve --pooling mean` on a model that declares last-token pooling: the server mean-pools."""
    directory = tmp_path / "embedder"
    build_qwen3_embedding(directory)
    with serve_cli("-m", str(directory), "--pooling", "mean") as base:
        got = httpx.post(base + "/v1/embeddings", json={"model": "embedder", "input": "The quick brown fox"},
                         timeout=60).json()["data"][0]["embedding"]
    loaded = load(directory, dtype="f32")
    want = embed(loaded.runner, embedding_ids(loaded.tokenizer, "The quick brown fox"), "mean")
    assert np.abs(np.array(got) - want).max() <= 1e-4
    bad = runlm("serve", "-m", str(directory), "--pooling", "max")
    assert bad.returncode == 2 and "--pooling" in bad.stderr


def test_error_lines_reach_the_terminal_without_escape_sequences():
    """A path (or anything read from a model file) holding ESC / OSC sequences is written out, not obeyed."""
    out = runlm("info", "/nonexistent/\x1b]0;pwned\x07\x1b[2J.gguf")
    assert out.returncode == 1
    assert "\x1b" not in out.stderr and "\x07" not in out.stderr
    assert "\\x1b]0;pwned\\x07\\x1b[2J.gguf" in out.stderr


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stdout, want", [
    (Terminal(), "hi \\x1b]52;c;cGF5bG9hZA==\\x07 \\x1b[2J done\r\n\tend\n"),  # an OSC 52 clipboard write, a clear
    (io.StringIO(), "hi \x1b]52;c;cGF5bG9hZA==\x07 \x1b[2J done\r\n\tend\n"),  # a pipe gets the text as generated
])
def test_streamed_reply_on_a_terminal_shows_escapes_as_text(monkeypatch, stdout, want):
    """Escape sequences split across streamed pieces are caught too (the check is per character)."""
    pieces = ["hi \x1b]52;c;cGF5bG9hZA==\x07 ", "\x1b", "[2J done\r\n\tend"]
    engine = SimpleNamespace(tokenizer=SimpleNamespace(encode_prompt=lambda text: [1]),
                             generate=lambda request: iter(StreamRecord(text=p) for p in pieces))
    args = SimpleNamespace(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert cli._stream_reply(engine, "prompt", args) == "".join(pieces)
    assert stdout.getvalue() == want


@pytest.mark.parametrize(("plan", "pieces"), [
    (ThinkingPlan("think"), ["<think>\nTwo and", " two.\n</think>\n\nIt is", " 4."]),
    (ThinkingPlan("harmony"), ["<|channel|>analysis<|message|>Two and", " two.<|end|><|start|>assistant",
                               "<|channel|>final<|message|>It is", " 4."]),
    (ThinkingPlan("gemma4"), ["<|channel>thought\nTwo and", " two.<channel|>It is", " 4."]),
])
@pytest.mark.parametrize(("stdout", "hide", "want"), [
    (Terminal, False, f"{cli.THINKING_STYLE}Two and two.{cli.ANSWER_STYLE}\n\nIt is 4.\n"),
    (io.StringIO, False, "Two and two.\n\nIt is 4.\n"),
    (Terminal, True, "It is 4.\n"),
])
def test_the_thinking_prints_dimmed_before_the_answer_or_not_at_all(monkeypatch, plan, pieces, stdout, hide, want):
    """The chat keeps only the answer for the next turn."""
    engine = SimpleNamespace(tokenizer=SimpleNamespace(encode_prompt=lambda text: [1]),
                             generate=lambda request: iter(StreamRecord(text=p) for p in pieces))
    args = SimpleNamespace(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, hide_thinking=hide)
    stdout = stdout()
    monkeypatch.setattr(sys, "stdout", stdout)
    assert cli._stream_reply(engine, "prompt", args, thinking=plan) == "It is 4."
    assert stdout.getvalue() == want


def test_think_switches_the_templates_thinking_or_leaves_it_to_the_template():
    from runlm.cli.commands import build_parser, template_switches
    from runlm.text.chat import ChatTemplate

    template = ChatTemplate("{{ 'on' if enable_thinking is defined and enable_thinking else 'off' }}")
    for argv, want in ((["generate", "hi"], "off"), (["generate", "--think", "hi"], "on"),
                       (["chat", "--no-think"], "off"), (["chat", "--think"], "on")):
        args = build_parser().parse_args(argv)
        assert template.render([{"role": "user", "content": "hi"}], **template_switches(args)) == want, argv
    assert template_switches(build_parser().parse_args(["chat"])) == {}


def test_kv_type_takes_f32_f16_or_q8_0(smollm2_gguf):
    bad = runlm("generate", "--kv-type", "q4_0", "hi")
    assert bad.returncode == 2 and "argument --kv-type: invalid choice: 'q4_0'" in bad.stderr
    refused = runlm("generate", "-m", str(smollm2_gguf), "--dtype", "f32", "--kv-type", "q8_0", "hi")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr  # one line, no traceback
    assert "kv_type 'q8_0' cannot be used here" in refused.stderr


def test_serve_bounds_requests_without_max_tokens_by_default():
    from runlm.cli.args import DEFAULT_SERVE_MAX_TOKENS, serve_options
    from runlm.cli.commands import build_parser

    args = build_parser().parse_args(["serve"])
    assert serve_options(args)["default_max_tokens"] == DEFAULT_SERVE_MAX_TOKENS == 2048
    assert serve_options(build_parser().parse_args(["serve", "--max-tokens", "7"]))["default_max_tokens"] == 7
