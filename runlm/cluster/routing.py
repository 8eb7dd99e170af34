"""Which replica serves a request: round-robin, power-of-two choices, and prefix affinity.

Pure Python (no Ray), so the Ray Serve request router and the routing simulator run the same policies.

Prefix affinity keeps router-side approximate state. The router hashes each prompt into a chain of block hashes
(`prefix_hashes`), remembers which replica it sent each chain to, and sends the next request to the replica that
already holds the longest part of its prefix: a growing chat comes back to the replica that has its history in the
prompt cache, and conversations that share a system prompt meet on the replicas that hold it. The map learns only
from the router's own decisions (`record`), so it needs no RPC to the replicas and adds nothing to their hot path.
The price: the router does not see what a replica really evicted. An LRU bound per replica (`capacity_blocks`, about
what one replica's prompt cache holds) stands in for the replica's own eviction, deepest blocks first, as a radix
tree evicts leaves first. Load wins over affinity when they disagree by more than `max_imbalance` requests: then
the request goes to the less loaded of two random replicas, which is also what an unmatched prompt gets.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Protocol

from runlm.errors import InvalidInputError

BLOCK_TOKENS = 16
# About what a replica's default prompt cache (`--prompt-cache-mb 256`) holds of SmolLM2-135M's float32 KV
# (30 layers x 3 KV heads x 64 dims x K and V x 4 bytes = 45 KiB per token): ~5.8k tokens, 364 blocks of 16.
DEFAULT_CAPACITY_BLOCKS = 364
DEFAULT_MAX_IMBALANCE = 4


def extend_prefix_hashes(hashes: Sequence[int], token_ids: Sequence[int],
                         block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """`prefix_hashes(token_ids)`, given `hashes` already computed for the first len(hashes) blocks of token_ids:
    a growing conversation hashes only its new blocks."""
    if block_tokens < 1:
        raise InvalidInputError(f"block_tokens must be at least 1, got {block_tokens}")
    chain = list(hashes)
    full_end = len(token_ids) // block_tokens * block_tokens
    try:
        packed = array("i", token_ids[len(chain) * block_tokens:full_end]).tobytes()
    except (OverflowError, TypeError) as error:
        raise InvalidInputError(f"token ids must be int32 integers: {error}") from None
    block_bytes = 4 * block_tokens
    previous = chain[-1].to_bytes(8, "little") if chain else bytes(8)
    for start in range(0, len(packed), block_bytes):
        previous = blake2b(previous + packed[start:start + block_bytes], digest_size=8).digest()
        chain.append(int.from_bytes(previous, "little"))
    return chain


def prefix_hashes(token_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[int]:
    """Chained 64-bit hashes of the prompt's full blocks: hash i identifies tokens [0, (i+1)*block_tokens).

    blake2b over (previous hash, the block's ids as int32 bytes): the same in every process and run (Python's
    own hash of bytes is salted per process), so two prompts with the same prefix share a chain prefix. The
    partial last block is left out: it cannot be reused as a block.
    """
    return extend_prefix_hashes([], token_ids, block_tokens)


class BlockLRU:
    """A replica's prompt cache as a set of chained block hashes, least recently used evicted first.

    `touch` marks a chain's deepest block least recent, so the deepest blocks go first and a held block's prefix
    is always held too (a radix tree's leaf-first eviction); `matched` can then read the longest held prefix from
    the deepest held hash.
    """

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise InvalidInputError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def __iter__(self):
        return iter(self._blocks)

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of `hashes` are held."""
        for index in range(len(hashes) - 1, -1, -1):
            if hashes[index] in self._blocks:
                return index + 1
        return 0

    def touch(self, hashes: Sequence[int]) -> list[int]:
        """Hold the chain as most recently used; returns the hashes evicted to stay within capacity."""
        blocks = self._blocks
        deepest_first = hashes[::-1]
        blocks.update(dict.fromkeys(deepest_first))
        deque(map(blocks.move_to_end, deepest_first), maxlen=0)  # the loop in C: the simulator touches millions
        return [blocks.popitem(last=False)[0] for _ in range(len(blocks) - self.capacity_blocks)]


class RoutingPolicy(Protocol):
    """What a router asks a policy; `replicas` is the non-empty list of live candidates, `load` their ongoing
    requests (a missing replica has 0)."""

    name: str

    def choose(self, hashes: Sequence[int], replicas: Sequence[str], load: Mapping[str, int]) -> str: ...

    def record(self, hashes: Sequence[int], replica: str) -> None:
        """Where a request actually ran."""

    def forget(self, replica: str) -> None:
        """The replica died or left."""


def _check_candidates(replicas: Sequence[str]) -> None:
    if not replicas:
        raise InvalidInputError("no replica to route to")


class RoundRobin:
    """Each replica in turn: the baseline that ignores both load and prompts."""

    name = "round-robin"

    def __init__(self, seed: int | None = None):
        # a random first turn: several routers (one per front process) do not all start on the same replica
        self._turn = random.Random(seed).randrange(2**16)

    def choose(self, hashes: Sequence[int], replicas: Sequence[str], load: Mapping[str, int]) -> str:
        _check_candidates(replicas)
        replica = replicas[self._turn % len(replicas)]
        self._turn += 1
        return replica

    def record(self, hashes: Sequence[int], replica: str) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


class PowerOfTwo:
    """The less loaded of two random replicas: near least-loaded balance without reading every replica's load."""

    name = "power-of-two"

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    def choose(self, hashes: Sequence[int], replicas: Sequence[str], load: Mapping[str, int]) -> str:
        _check_candidates(replicas)
        if len(replicas) == 1:
            return replicas[0]
        first, second = self._rng.sample(range(len(replicas)), 2)
        a, b = replicas[first], replicas[second]
        return b if load.get(b, 0) < load.get(a, 0) else a

    def record(self, hashes: Sequence[int], replica: str) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


class PrefixAffinity:
    """The replica holding the longest prefix of the prompt, unless that replica is overloaded (see the module
    docstring for the approach and its limits)."""

    name = "prefix-affinity"

    def __init__(self, capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                 seed: int | None = None):
        if max_imbalance < 0:
            raise InvalidInputError(f"max_imbalance must be at least 0, got {max_imbalance}")
        BlockLRU(capacity_blocks)  # validates the capacity now, not at the first record
        self.capacity_blocks = capacity_blocks
        self.max_imbalance = max_imbalance
        self._rng = random.Random(seed)
        self._fallback = PowerOfTwo(seed=self._rng.randrange(2**32))
        self._held: dict[str, BlockLRU] = {}
        self._holders: dict[int, set[str]] = {}

    def matched_blocks(self, hashes: Sequence[int], replica: str) -> int:
        """How many leading blocks of `hashes` the router believes `replica` holds."""
        held = self._held.get(replica)
        return held.matched(hashes) if held is not None else 0

    def choose(self, hashes: Sequence[int], replicas: Sequence[str], load: Mapping[str, int]) -> str:
        _check_candidates(replicas)
        best = self._longest_match(hashes, replicas)
        if not best:
            return self._fallback.choose(hashes, replicas, load)
        least_best = min(load.get(replica, 0) for replica in best)
        least_anywhere = min(load.get(replica, 0) for replica in replicas)
        if least_best - least_anywhere > self.max_imbalance:
            return self._fallback.choose(hashes, replicas, load)
        return self._rng.choice([replica for replica in best if load.get(replica, 0) == least_best])

    def _longest_match(self, hashes: Sequence[int], replicas: Sequence[str]) -> list[str]:
        """The live replicas holding the deepest block of `hashes` any live replica holds (sorted: a choice among
        them must not depend on set order)."""
        live = None
        for index in range(len(hashes) - 1, -1, -1):
            holders = self._holders.get(hashes[index])
            if not holders:
                continue
            if live is None:
                live = set(replicas)
            found = sorted(holders & live)
            if found:
                return found
        return []

    def record(self, hashes: Sequence[int], replica: str) -> None:
        held = self._held.get(replica)
        if held is None:
            held = self._held[replica] = BlockLRU(self.capacity_blocks)
        for block_hash in hashes:
            self._holders.setdefault(block_hash, set()).add(replica)
        for block_hash in held.touch(hashes):
            self._drop_holder(block_hash, replica)

    def forget(self, replica: str) -> None:
        held = self._held.pop(replica, None)
        for block_hash in held or ():
            self._drop_holder(block_hash, replica)

    def _drop_holder(self, block_hash: int, replica: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]


POLICIES = {policy.name: policy for policy in (RoundRobin, PowerOfTwo, PrefixAffinity)}


def make_policy(name: str, **kwargs) -> RoutingPolicy:
    """A policy by name: "round-robin", "power-of-two" or "prefix-affinity"; kwargs go to its constructor."""
    policy = POLICIES.get(name)
    if policy is None:
        raise InvalidInputError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    try:
        return policy(**kwargs)
    except TypeError as error:
        raise InvalidInputError(f"routing policy {name!r}: {error}") from None
