"""The store's lookup counters: hits by kind, tokens reused, and a window over the latest lookups."""

from __future__ import annotations

from collections import Counter, deque

from .store_types import RECENT_WINDOW, HitKind


class LookupCounters:
    """Lookup counters, with a window over the most recent lookups."""

    def __init__(self):
        self.by_hit: Counter[str] = Counter()
        self.num_reused_tokens = self.num_lookup_tokens = 0
        self.recent: deque[tuple[int, int]] = deque(maxlen=RECENT_WINDOW)

    def record(self, hit: HitKind, length: int, num_tokens: int) -> None:
        self.by_hit[hit] += 1
        self.num_reused_tokens += length
        self.num_lookup_tokens += num_tokens
        self.recent.append((length, num_tokens))

    def recent_rates(self) -> tuple[float, float]:
        num_recent = max(len(self.recent), 1)
        num_reusing = sum(1 for length, _ in self.recent if length)
        num_reused = sum(length for length, _ in self.recent)
        return num_reusing / num_recent, num_reused / max(sum(n for _, n in self.recent), 1)
