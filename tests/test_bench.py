"""`runlm bench` end to end on the real SmolLM2 GGUF (tiny sizes: this checks the procedure, not the speed)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_runs_each_peer_with_repeats(smollm2_gguf, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--prompt-tokens", "16", "--gen-tokens", "3", "--ppl-tokens", "64", "--repeat", "2", "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "runlm.cli", "bench", "-m", str(smollm2_gguf), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "best of: 2" in proc.stdout and "| runlm " in proc.stdout
    report = json.loads(out.read_text())
    (ours,) = [r for r in report["results"] if r["peer"] == "runlm"]
    assert ours["decode_tok_s"] > 0 and ours["prefill_tok_s"] > 0 and ours["load_s"] > 0
    assert 1 < ours["ppl"] < 1000  # a real model on real English: nowhere near uniform (49152)


def test_bench_without_perplexity(smollm2_gguf, tmp_path, capsys):
    """--ppl-tokens 0 leaves perplexity out: '-' in the table and null in the JSON, not a made-up figure."""
    from runlm.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "-m", str(smollm2_gguf), "--prompt-tokens", "8", "--gen-tokens", "2", "--ppl-tokens", "0",
                 "--repeat", "1", "--threads", "1", "--json", str(out)]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| runlm ")]
    assert row.split("|")[-2].strip() == "-"
    (ours,) = json.loads(out.read_text())["results"]
    assert ours["ppl"] is None and ours["decode_tok_s"] > 0


def test_bench_kernels_times_each_weight_type(smollm2_gguf, capsys):
    from runlm.cli import main

    assert main(["bench", "-m", str(smollm2_gguf), "--kernels", "--threads", "1"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| blk.")
            or line.startswith("| token_embd")]
    assert {row[2].strip() for row in rows} == {"Q4_1", "Q8_0"}  # SmolLM2's two weight types
    assert {row[4].strip() for row in rows} == {"1", "17", "128"}
    assert all(float(row[5]) > 0 and float(row[6]) > 0 for row in rows)


def test_bench_streams_reports_batching_admission_serving_and_routes(smollm2_gguf, capsys):
    """The engine bench (`--streams`): its table, the long-prompt admission line, served vs direct and the
    route-invariance line, with numbers in them (the procedure; the speed is the README's table)."""
    import re

    from runlm.cli import main

    assert main(["bench", "-m", str(smollm2_gguf), "--streams", "1,2", "--gen-tokens", "6", "--repeat", "1",
                 "--admit-tokens", "300", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|")[1:-1] for line in out.splitlines() if re.match(r"\| [12] \|", line)]
    assert [int(row[0]) for row in rows] == [1, 2] and all(float(row[1]) > 0 for row in rows)
    assert re.search(r"a 300-token prompt admitted beside 2 streams \(its first token after [\d.]+ s\): their "
                     r"ITL p50 [\d.]+ -> [\d.]+ ms", out)
    assert re.search(r"one stream served over HTTP: [\d.]+ tok/s vs the runner's own loop [\d.]+ tok/s", out)
    assert re.search(r"served / direct in \d+ adjacent pairs: median \d+%, \d+%-\d+%", out)
    assert "max |delta logit| 0\n" in out  # the packed path is route-invariant: bit-identical logits
