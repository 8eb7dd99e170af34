"""Routing policies: stable prefix hashes, and where each policy sends a request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runlm.cluster.routing import (
    BLOCK_TOKENS,
    BlockLRU,
    PowerOfTwo,
    PrefixAffinity,
    RoundRobin,
    extend_prefix_hashes,
    make_policy,
    prefix_hashes,
)
from runlm.errors import InvalidInputError

PROMPT = list(range(1000, 1000 + 5 * BLOCK_TOKENS + 7))  # five full blocks and a partial one


def test_hashes_are_the_same_in_another_process_with_another_hash_seed():
    code = "from runlm.cluster.routing import prefix_hashes; print(prefix_hashes(list(range(1000, 1087))))"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(prefix_hashes(PROMPT))
    assert prefix_hashes(PROMPT) == prefix_hashes(list(PROMPT))


def test_one_64_bit_hash_per_full_block_and_the_partial_block_is_ignored():
    hashes = prefix_hashes(PROMPT)
    assert len(hashes) == 5
    assert all(0 <= h < 2**64 for h in hashes)
    assert prefix_hashes(PROMPT[:5 * BLOCK_TOKENS]) == hashes
    assert prefix_hashes(PROMPT[:BLOCK_TOKENS - 1]) == []


def test_chains_share_exactly_the_shared_prefix():
    follow_up = PROMPT + list(range(40))
    assert prefix_hashes(follow_up)[:5] == prefix_hashes(PROMPT)
    changed = list(PROMPT)
    changed[2 * BLOCK_TOKENS + 3] += 1  # inside block 2: blocks 0-1 match, every later hash differs
    ours, theirs = prefix_hashes(PROMPT), prefix_hashes(changed)
    assert ours[:2] == theirs[:2]
    assert all(a != b for a, b in zip(ours[2:], theirs[2:]))
    # the same block content after a different prefix hashes differently: a hash names the whole prefix
    assert prefix_hashes(PROMPT[BLOCK_TOKENS:2 * BLOCK_TOKENS])[0] != prefix_hashes(PROMPT)[1]


def test_extending_a_chain_equals_hashing_the_whole_prompt():
    follow_up = PROMPT + list(range(100))
    assert extend_prefix_hashes(prefix_hashes(PROMPT), follow_up) == prefix_hashes(follow_up)
    assert prefix_hashes(PROMPT, block_tokens=4) == extend_prefix_hashes(prefix_hashes(PROMPT[:9], 4), PROMPT, 4)


def test_bad_token_ids_and_block_sizes_are_typed_errors():
    with pytest.raises(InvalidInputError):
        prefix_hashes([2**40] * BLOCK_TOKENS)
    with pytest.raises(InvalidInputError):
        prefix_hashes(PROMPT, block_tokens=0)


def test_round_robin_cycles_through_every_replica():
    policy = RoundRobin(seed=0)
    replicas = ["a", "b", "c"]
    chosen = [policy.choose([], replicas, {}) for _ in range(6)]
    assert sorted(chosen[:3]) == replicas
    assert chosen[3:] == chosen[:3]


def test_power_of_two_picks_the_less_loaded_of_its_two_candidates():
    # with two replicas both are always the candidates, so the less loaded one must win every time
    policy = PowerOfTwo(seed=0)
    assert {policy.choose([], ["busy", "idle"], {"busy": 5}) for _ in range(20)} == {"idle"}
    # with many, the most loaded replica can never win (its rival is always less loaded)
    load = {f"r{i}": i for i in range(10)}
    chosen = [policy.choose([], list(load), load) for _ in range(200)]
    assert "r9" not in chosen
    assert len(set(chosen)) > 3
    assert PowerOfTwo(seed=0).choose([], ["only"], {}) == "only"


def test_power_of_two_is_reproducible_for_a_seed():
    replicas = [f"r{i}" for i in range(8)]
    first, second = PowerOfTwo(seed=3), PowerOfTwo(seed=3)
    assert [first.choose([], replicas, {}) for _ in range(30)] == [second.choose([], replicas, {}) for _ in range(30)]


def test_prefix_affinity_sends_a_follow_up_to_the_replica_that_ran_its_prefix():
    policy = PrefixAffinity(seed=0)
    replicas = [f"r{i}" for i in range(16)]
    first = prefix_hashes(PROMPT)
    policy.record(first, "r7")
    follow_up = prefix_hashes(PROMPT + list(range(64)))
    assert policy.matched_blocks(follow_up, "r7") == 5
    assert policy.matched_blocks(follow_up, "r3") == 0
    assert {policy.choose(follow_up, replicas, {"r7": 2}) for _ in range(10)} == {"r7"}


def test_prefix_affinity_prefers_the_longest_match_then_the_less_loaded():
    policy = PrefixAffinity(seed=0)
    replicas = ["a", "b", "c"]
    system = list(range(3 * BLOCK_TOKENS))
    history = system + list(range(500, 500 + 2 * BLOCK_TOKENS))
    policy.record(prefix_hashes(system), "a")
    policy.record(prefix_hashes(history), "b")
    policy.record(prefix_hashes(system), "c")
    assert policy.choose(prefix_hashes(history + [1] * 40), replicas, {"b": 3}) == "b"
    other_user = prefix_hashes(system + list(range(900, 900 + 40)))
    assert policy.matched_blocks(other_user, "b") == 3  # b's history starts with the same system prompt
    assert policy.choose(other_user, replicas, {"a": 2, "b": 1}) == "c"


def test_prefix_affinity_falls_back_to_load_when_the_match_is_overloaded_or_absent():
    policy = PrefixAffinity(max_imbalance=4, seed=0)
    replicas = ["hot", "cold"]
    hashes = prefix_hashes(PROMPT)
    policy.record(hashes, "hot")
    assert policy.choose(hashes, replicas, {"hot": 4, "cold": 0}) == "hot"  # 4 more is still within the bound
    assert policy.choose(hashes, replicas, {"hot": 5, "cold": 0}) == "cold"
    unseen = prefix_hashes(list(range(7000, 7100)))
    assert {policy.choose(unseen, replicas, {"hot": 1}) for _ in range(10)} == {"cold"}


def test_prefix_affinity_forgets_a_dead_replica():
    policy = PrefixAffinity(seed=0)
    hashes = prefix_hashes(PROMPT)
    policy.record(hashes, "dead")
    policy.record(hashes[:2], "alive")
    policy.forget("dead")
    assert policy.matched_blocks(hashes, "dead") == 0
    # even listed as a candidate, the forgotten replica no longer attracts its prefix
    assert {policy.choose(hashes, ["dead", "alive"], {}) for _ in range(10)} == {"alive"}


def test_prefix_affinity_evicts_least_recently_used_blocks_past_its_capacity():
    policy = PrefixAffinity(capacity_blocks=8, seed=0)
    old, new = prefix_hashes(list(range(5 * BLOCK_TOKENS))), prefix_hashes(list(range(1, 1 + 5 * BLOCK_TOKENS)))
    policy.record(old, "r")
    policy.record(new, "r")
    assert policy.matched_blocks(new, "r") == 5
    # 10 blocks for 8 places: the old chain loses its two deepest blocks, its prefix stays
    assert policy.matched_blocks(old, "r") == 3
    policy.record(old, "s")
    assert policy.choose(old, ["r", "s"], {}) == "s"


def test_block_lru_keeps_prefixes_and_evicts_deepest_first():
    cache = BlockLRU(capacity_blocks=3)
    assert cache.touch([1, 2, 3]) == []
    assert cache.touch([1, 2, 4]) == [3]  # 3 is the deepest block of the older chain
    assert cache.matched([1, 2, 3]) == 2
    assert cache.matched([1, 2, 4, 5]) == 3
    assert cache.touch([9, 8]) == [4, 2]  # [9, 8] is newer; what is left of [1, 2, 4] goes from its end
    assert cache.matched([1, 2, 4]) == 1
    with pytest.raises(InvalidInputError):
        BlockLRU(0)


def test_make_policy_builds_each_policy_by_name_and_rejects_unknown_ones():
    for name in ("round-robin", "power-of-two", "prefix-affinity"):
        assert make_policy(name, seed=1).name == name
    assert make_policy("prefix-affinity", capacity_blocks=10, max_imbalance=2).max_imbalance == 2
    with pytest.raises(InvalidInputError):
        make_policy("random")
    with pytest.raises(InvalidInputError):
        make_policy("round-robin", capacity_blocks=10)
    with pytest.raises(InvalidInputError):
        RoundRobin().choose([], [], {})
