"""runlm bench --health: its table, from a real `runlm serve` attacked from a process of its own."""

from __future__ import annotations

import re

from runlm.bench import health as bench_health


def test_bench_health_prints_each_attack_with_its_latencies(smollm2_gguf, capsys, monkeypatch):
    from runlm.cli.commands import main

    monkeypatch.setattr(bench_health, "BENCH_ATTACKS", ("tool-whitespace",))  # one quick attack: the procedure
    assert main(["bench", "-m", str(smollm2_gguf), "--health", "--repeat", "1", "--threads", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| a 32k-space")]
    assert len(rows) == 1
    probes, p50, p99, worst, replies = rows[0].split("|")[2:7]
    assert int(probes) > 0 and 0 < float(p50) <= float(p99) <= float(worst)
    assert re.fullmatch(r" 1 x 200 ", replies)
