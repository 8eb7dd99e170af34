"""Longest-prefix reuse of session snapshots under a byte budget, least recently used evicted first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from runlm.runner import SessionSnapshot


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    stores: int = 0
    evictions: int = 0


class PromptCache:
    """Snapshots keyed by their token ids.

    A lookup returns the snapshot sharing the longest prefix with the new prompt, so a chat's next turn
    or a shared system prompt only prefills its new suffix. A snapshot whose tokens are a prefix of a
    newer one is dropped (the newer covers it); past `budget_bytes` the least recently used go.
    Every entry belongs to a `scope` (the server's tenant: one per API key): a lookup sees only its own
    scope's entries, so one client can neither reuse nor probe (through `cached_tokens` or timing) another's
    prompts. The byte budget is shared.
    """

    def __init__(self, budget_bytes: int, min_reuse: int = 1):
        self.budget_bytes = max(0, int(budget_bytes))
        self.min_reuse = max(1, min_reuse)
        self._entries: OrderedDict[int, SessionSnapshot] = OrderedDict()
        self._scopes: dict[int, str] = {}
        self._next_key = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def _in_scope(self, scope: str) -> list[tuple[int, SessionSnapshot]]:
        return [(key, snap) for key, snap in self._entries.items() if self._scopes[key] == scope]

    def lookup(self, prompt: Sequence[int], scope: str = "") -> tuple[SessionSnapshot | None, int]:
        """(snapshot of `scope`, number of leading prompt tokens it covers), or (None, 0)."""
        with self._lock:
            self.stats.lookups += 1
            best_key, best_len = None, 0
            for key, snap in self._in_scope(scope):
                n = common_prefix(snap.token_ids, prompt)
                if n > best_len:
                    best_key, best_len = key, n
            if best_key is None or best_len < self.min_reuse:
                return None, 0
            self._entries.move_to_end(best_key)
            return self._entries[best_key], best_len

    def record_hit(self, tokens: int) -> None:
        with self._lock:
            if tokens > 0:
                self.stats.hits += 1
                self.stats.hit_tokens += tokens

    def store(self, snap: SessionSnapshot | None, scope: str = "") -> bool:
        """Keep a snapshot in `scope` if it fits the budget; True if it was kept."""
        if snap is None or not snap.token_ids or snap.nbytes > self.budget_bytes:
            return False
        with self._lock:
            own = self._in_scope(scope)
            for key, old in own:
                if common_prefix(old.token_ids, snap.token_ids) == len(snap.token_ids):
                    self._entries.move_to_end(key)  # an existing snapshot already covers this one
                    return False
            for key in [k for k, s in own if common_prefix(s.token_ids, snap.token_ids) == len(s.token_ids)]:
                self._drop(key)  # covered by the new, longer snapshot
            self._entries[self._next_key] = snap
            self._scopes[self._next_key] = scope
            self._next_key += 1
            self.stats.stores += 1
            total = self.nbytes
            while total > self.budget_bytes and self._entries:
                oldest = next(iter(self._entries))
                total -= self._entries[oldest].nbytes
                self._drop(oldest)
                self.stats.evictions += 1
            return True

    def _drop(self, key: int) -> None:
        del self._entries[key], self._scopes[key]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._scopes.clear()
