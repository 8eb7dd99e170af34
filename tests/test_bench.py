"""`runlm bench` end to end on the real SmolLM2 GGUF (tiny sizes: this checks the procedure, not the speed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def test_bench_runs_each_peer_with_repeats(smollm2_gguf, tmp_path):
    """Two peers (runlm and its float32 reference: no optional package needed) take alternating rounds; the table
    gives each one's best round and the runlm / peer ratio of each pair of rounds."""
    out = tmp_path / "bench.json"
    args = ["--prompt-tokens", "16", "--gen-tokens", "3", "--ppl-tokens", "64", "--repeat", "3", "--threads", "1",
            "--vs", "runlm-f32"]
    proc = subprocess.run(
        [sys.executable, "-m", "runlm", "bench", "-m", str(smollm2_gguf), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "best of: 3" in proc.stdout and "| runlm " in proc.stdout and "| runlm-f32 " in proc.stdout
    assert "runlm/runlm-f32 round by round (3 alternating rounds): prefill median" in proc.stdout
    assert proc.stderr.count("bench: round ") == 3
    # the kernels are built (or found in the cache) before any peer's timed load
    assert proc.stderr.index("bench: runlm's kernels ready") < proc.stderr.index("bench: loading runlm")
    report = json.loads(out.read_text())
    ours, reference = report["results"]
    assert (ours["peer"], reference["peer"]) == ("runlm", "runlm-f32")
    assert ours["decode_tok_s"] > 0 and ours["prefill_tok_s"] > 0 and ours["load_s"] > 0
    assert 1 < ours["ppl"] < 1000  # a real model on real English: nowhere near uniform (49152)
    for row in (ours, reference):
        assert len(row["rounds"]) == 3
        assert row["decode_tok_s"] == max(r["decode_tok_s"] for r in row["rounds"])
    # a probe before the first round and after each peer's round; the limit from the best probe, and each round
    # against the mean of the two probes beside it
    limit = report["decode_limit"]
    probes = limit["bandwidth_probes_gb_s"]
    assert len(probes) == 7 and limit["bandwidth_gb_s"] == max(probes)
    assert "best of 7 probes" in proc.stdout
    assert ours["round_bandwidths_gb_s"] == pytest.approx([(probes[i] + probes[i + 1]) / 2 for i in (0, 2, 4)])
    assert reference["round_bandwidths_gb_s"] == pytest.approx([(probes[i] + probes[i + 1]) / 2 for i in (1, 3, 5)])
    shares = sorted(r["decode_tok_s"] * limit["weights_bytes_per_token"] / (gb_s * 1e9)
                    for r, gb_s in zip(ours["rounds"], ours["round_bandwidths_gb_s"]))
    assert limit["round_shares"]["runlm"] == pytest.approx({"median": shares[1], "min": shares[0], "max": shares[2]})
    assert re.search(r"  runlm: decode [\d.]+ tok/s = \d+% of the limit; round by round against the probes beside "
                     r"each: median \d+% \(\d+%-\d+%\)", proc.stdout)
    for row in (ours, reference):  # memory by stage: the libraries, the model loaded, the peak after the rounds
        assert 0 < row["libraries_rss_mb"] < row["loaded_rss_mb"] <= row["peak_rss_mb"]
    assert ours["kv_mb"] > 0 and reference["kv_mb"] == pytest.approx(2 * ours["kv_mb"])  # f16 against f32 caches
    assert re.search(r"  runlm: \d+ / \d+ / \d+, the peak is the file \+ \d+\n", proc.stdout)
    assert re.search(r"  file \+ KV cache \(\d+: runlm's caches for 19 positions\) \+ 150 = \d+\n", proc.stdout)
    paired = report["paired"]["runlm-f32"]
    ratios = sorted(a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(ours["rounds"], reference["rounds"]))
    assert paired["rounds"] == 3 and paired["decode_tok_s"]["median"] == pytest.approx(ratios[1])
    assert paired["decode_tok_s"]["min"] == pytest.approx(ratios[0])
    per_gb_s = sorted(a["decode_tok_s"] / a_gb / (b["decode_tok_s"] / b_gb) for a, b, a_gb, b_gb in zip(
        ours["rounds"], reference["rounds"], ours["round_bandwidths_gb_s"], reference["round_bandwidths_gb_s"]))
    assert paired["decode_per_bandwidth"]["median"] == pytest.approx(per_gb_s[1])
    assert "decode per GB/s probed beside the round median" in proc.stdout


def test_a_peer_that_fails_to_load_is_skipped_with_its_reason(tmp_path):
    """A worker that dies (here: a model file that is not a GGUF) is reported as skipped, with the last line it
    wrote, and the bench does not hang waiting for its reply."""
    from runlm.bench import peers

    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    spec = {"path": str(bogus), "threads": 1, "prompt_ids": [1, 2], "gen_tokens": 1, "repeat": 1, "ppl_ids": [],
            "kv_type": "auto", "peer": "runlm"}
    worker = peers.PeerWorker(spec)
    assert worker.error is not None and worker.error.startswith("worker failed: ")
    assert "GGUF" in worker.error or "gguf" in worker.error
    assert worker.round() == {"error": worker.error}
    assert worker.finish() == {"error": worker.error}


def test_bench_without_perplexity(smollm2_gguf, tmp_path, capsys):
    """--ppl-tokens 0 leaves perplexity out: '-' in the table and null in the JSON, not a made-up figure."""
    from runlm.cli.commands import main

    out = tmp_path / "bench.json"
    assert main(["bench", "-m", str(smollm2_gguf), "--prompt-tokens", "8", "--gen-tokens", "2", "--ppl-tokens", "0",
                 "--repeat", "1", "--threads", "1", "--json", str(out)]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| runlm ")]
    assert row.split("|")[-2].strip() == "-"
    (ours,) = json.loads(out.read_text())["results"]
    assert ours["ppl"] is None and ours["decode_tok_s"] > 0


def test_bench_kernels_times_each_weight_type(smollm2_gguf, capsys):
    from runlm.cli.commands import main

    assert main(["bench", "-m", str(smollm2_gguf), "--kernels", "--threads", "1"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| blk.")
            or line.startswith("| token_embd")]
    assert {row[2].strip() for row in rows} == {"Q4_1", "Q8_0"}  # SmolLM2's two weight types
    assert {row[4].strip() for row in rows} == {"1", "17", "128"}
    assert all(float(row[5]) > 0 and float(row[6]) > 0 for row in rows)


def test_token_latencies_share_a_steps_wait_among_its_tokens():
    """Tokens that arrive together (a verified draft) each get their share of the wait before them, not a gap of 0."""
    from runlm.bench.streams import token_latencies

    times = [0.0, 0.010, 0.030, 0.030 + 1e-6, 0.030 + 2e-6, 0.050]
    assert token_latencies(times) == pytest.approx([0.010, 0.020 / 3, 0.020 / 3, 0.020 / 3, 0.020], abs=1e-5)
    assert token_latencies([1.0]) == [] and token_latencies([]) == []


def test_bench_streams_reports_batching_admission_serving_and_routes(smollm2_gguf, capsys):
    """The engine bench (`--streams`): its table, the long-prompt admission line, served vs direct and the
    route-invariance line, with numbers in them (the procedure; the speed is the README's table)."""
    import re

    from runlm.cli.commands import main

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


def test_every_peer_is_paired_with_runlm_round_by_round():
    """Each peer's rounds against runlm's (what `runlm generate` runs), one ratio per alternating round."""
    from runlm.bench.peers import paired_with

    def row(peer: str, decodes: list[float]) -> dict:
        return {"peer": peer, "rounds": [{"prefill_tok_s": 100.0, "decode_tok_s": d} for d in decodes]}

    results = [row("runlm", [12, 15, 13]), row("runlm-torch", [10, 11, 12]), row("llama.cpp", [10, 10, 10])]
    paired = paired_with(results)
    assert list(paired) == ["runlm-torch", "llama.cpp"]
    assert paired["llama.cpp"]["decode_tok_s"] == {"median": 1.3, "min": 1.2, "max": 1.5}
    assert paired_with(results[1:]) == {}



def test_the_model_file_is_read_before_any_peer_loads(tmp_path):
    """warm_page_cache reads the whole file in chunks (so no peer's load column counts the disk), and passes over a
    missing one."""
    from runlm.bench import peers

    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(range(256)) * 40_000)
    assert peers.warm_page_cache(path, chunk=1 << 20) == path.stat().st_size
    assert peers.warm_page_cache(tmp_path / "absent.gguf") == 0
