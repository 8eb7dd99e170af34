"""The routing simulator: its cost model and event machinery on hand-made traces, and the policies on tiny ones."""

from __future__ import annotations

import json

import pytest

from runlm.cluster.routing import POLICIES, PrefixAffinity, RoundRobin
from runlm.cluster.simulate import (
    Conversation,
    CostModel,
    TraceConfig,
    Turn,
    build_policy,
    format_table,
    main,
    make_trace,
    run_simulation,
    simulate,
)
from runlm.errors import InvalidInputError

TINY = TraceConfig(conversations_per_replica=6, turns=(3, 5))
COST = CostModel(prefill_tok_s=1250.0, decode_tok_s=200.0, restore_s=0.01)


def one_turn(prompt_tokens: int, reply_tokens: int, think_s: float = 0.0) -> Turn:
    return Turn(prompt_tokens, reply_tokens, prompt_tokens // 16, (prompt_tokens + reply_tokens) // 16, think_s)


def test_step_cost_is_fitted_to_one_stream_and_the_full_batch():
    assert COST.step_s(1) == pytest.approx(1 / 200)
    assert COST.max_batch / COST.step_s(COST.max_batch) == pytest.approx(COST.batch_speedup * 200)
    assert COST.step_s(1) < COST.step_s(4) < COST.step_s(8)  # a step costs more with more streams...
    assert 4 / COST.step_s(4) > 1 / COST.step_s(1)  # ...but carries more tokens per second


def test_a_lone_request_costs_its_prefill_then_its_decode_and_a_follow_up_reuses_the_cache():
    chain = list(range(1, 60))
    first, second = one_turn(500, 101), one_turn(700, 20, think_s=5.0)
    result = simulate([Conversation(0.0, chain, [first])], 1, RoundRobin(), COST)
    assert result.ttft_p99_s == pytest.approx(500 / 1250)
    assert result.duration_s == pytest.approx(500 / 1250 + 100 * COST.step_s(1))
    assert result.cached_tokens == 0

    result = simulate([Conversation(0.0, chain, [first, second])], 1, RoundRobin(), COST)
    cached = first.done_blocks * 16  # the first turn's prompt and reply, in whole blocks
    assert result.cached_tokens == cached
    assert result.prompt_tokens == 1200
    assert result.ttft_p50_s == pytest.approx(500 / 1250)  # nearest rank: the upper of two
    assert result.ttft_p99_s == pytest.approx(500 / 1250)
    assert result.duration_s == pytest.approx(500 / 1250 + 100 * COST.step_s(1) + 5.0
                                              + (700 - cached) / 1250 + 0.01 + 19 * COST.step_s(1))


def test_prefills_run_one_at_a_time_then_the_batch_decodes_together():
    conversations = [Conversation(0.0, [1, 2, 3, 4, 5, 6, 7, 8], [one_turn(125, 11)]),
                     Conversation(0.0, [11, 12, 13, 14, 15, 16, 17, 18], [one_turn(125, 11)])]
    result = simulate(conversations, 1, RoundRobin(), COST)
    assert result.ttft_p99_s == pytest.approx(0.2)  # the second waited for the first's prefill
    assert result.duration_s == pytest.approx(0.2 + 10 * COST.step_s(2))
    # arriving mid-decode, a prompt pauses the running request for its prefill, then both decode together
    late = [Conversation(0.0, [1, 2, 3, 4, 5, 6, 7, 8, 9], [one_turn(125, 21)]),
            Conversation(0.15, [11, 12, 13, 14, 15, 16, 17, 18], [one_turn(125, 11)])]
    result = simulate(late, 1, RoundRobin(), COST)
    assert result.ttft_p99_s == pytest.approx(0.1)
    assert result.duration_s == pytest.approx(0.25 + 10 * COST.step_s(2))
    # a batch of one: the second request waits in the queue for the first to end
    single = CostModel(prefill_tok_s=1250.0, decode_tok_s=200.0, batch_speedup=1.0, max_batch=1)
    result = simulate(conversations, 1, RoundRobin(), single)
    assert result.ttft_p99_s == pytest.approx(0.1 + 10 * single.step_s(1) + 0.1)


def test_conversations_on_one_system_prompt_share_exactly_its_blocks():
    config = TraceConfig(conversations_per_replica=4, system_prompts_per_replica=0.1, system_tokens=(100, 100))
    conversations = make_trace(2, config, seed=3)
    chains = [conversation.chain for conversation in conversations]
    assert all(chain[:6] == chains[0][:6] for chain in chains)  # 100 tokens: 6 full blocks
    assert len({chain[6] for chain in chains}) == len(chains)
    for conversation in conversations:
        blocks = [turn.prompt_blocks for turn in conversation.turns]
        assert blocks == sorted(blocks) and blocks[-1] <= conversation.turns[-1].done_blocks == len(conversation.chain)


def test_a_seed_replays_the_same_run_and_another_seed_does_not():
    def run(seed: int):
        trace = make_trace(4, TINY, seed=seed)
        return [simulate(trace, 4, build_policy(name, COST, seed), COST) for name in POLICIES]

    first = run(1)
    assert run(1) == first
    assert run(2) != first
    assert all(result.requests == sum(len(c.turns) for c in make_trace(4, TINY, seed=1)) for result in first)


def test_prefix_affinity_hits_the_prompt_cache_more_than_round_robin_on_multi_turn_chats():
    trace = make_trace(8, TINY, seed=0)
    round_robin = simulate(trace, 8, build_policy("round-robin", COST, 0), COST)
    affinity = simulate(trace, 8, build_policy("prefix-affinity", COST, 0), COST)
    assert affinity.hit_rate > round_robin.hit_rate + 0.2
    assert affinity.ttft_p50_s < round_robin.ttft_p50_s


def test_the_simulation_bounds_prefix_affinity_by_the_replica_cache():
    policy = build_policy("prefix-affinity", COST, 0)
    assert isinstance(policy, PrefixAffinity)
    assert policy.capacity_blocks == COST.prompt_cache_tokens // COST.block_tokens


def test_the_table_has_a_row_per_policy_and_replica_count():
    results = run_simulation([2, 3], trace=TraceConfig(conversations_per_replica=2))
    table = format_table(results).splitlines()
    assert len(table) == 2 + 2 * len(POLICIES)
    for name in POLICIES:
        assert sum(f"| {name} |" in line for line in table) == 2


def test_cost_model_from_json_overrides_defaults_and_rejects_unknown_keys(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"prefill_tok_s": 400, "max_batch": 4}))
    cost = CostModel.from_json(path)
    assert (cost.prefill_tok_s, cost.max_batch, cost.decode_tok_s) == (400, 4, CostModel().decode_tok_s)
    path.write_text(json.dumps({"prefill_toks": 400}))
    with pytest.raises(InvalidInputError, match="prefill_toks"):
        CostModel.from_json(path)
    with pytest.raises(InvalidInputError):
        CostModel(batch_speedup=9.0)


def test_the_cli_prints_the_table_and_writes_json_and_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot, report = tmp_path / "sim.png", tmp_path / "sim.json"
    argv = ["--replicas", "2,4", "--conversations-per-replica", "2", "--plot", str(plot), "--json", str(report)]
    assert main(argv) == 0
    assert "| prefix-affinity |" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads(report.read_text())["results"]
    assert {(row["replicas"], row["policy"]) for row in results} == {(r, p) for r in (2, 4) for p in POLICIES}


def test_the_cli_rejects_unknown_policies(capsys):
    assert main(["--replicas", "2", "--policies", "random"]) == 1
    assert "random" in capsys.readouterr().err
