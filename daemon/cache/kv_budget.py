"""The KV memory budget (``--cache-bytes``): the prefix store and the running sequences share it.

One object owns the figures: the whole budget, what the running sequences
have reserved, what a side run (the shadow check) has reserved, and so what
the store may hold. The scheduler reserves before a sequence runs what its KV
can grow to (``reserve_running``); the store holds at most the rest
(``store_capacity``, read whenever it makes room) and evicts down to it as
soon as a reservation grows, so that stored bytes plus reservations stay
within the budget at every moment. An ended reservation gives the store its
room back. Only what the store cannot evict (leased or pinned entries) may
keep its capacity above the rest, and the capacity then says so.
"""

from __future__ import annotations

from typing import Protocol

# A side run may cost the store at most this share of the budget in evictions (1/16).
SIDE_EVICTION_SHARE = 16


class BudgetedStore(Protocol):
    """The store whose bytes count against a KvBudget."""

    @property
    def num_bytes(self) -> int: ...

    def evict_down_to(self, max_bytes: int) -> int:
        """Evict until at most max_bytes are held, as far as leases and pins allow; return the bytes held."""
        ...


class KvBudget:
    """Stored bytes plus the running sequences' and a side run's reservations, within ``total_bytes``."""

    def __init__(self, total_bytes: int):
        if total_bytes < 0:
            raise ValueError(f"a KV budget cannot be negative, got {total_bytes}")
        self.total_bytes = total_bytes
        self.running_bytes = 0  # what the running sequences' KV may grow to
        self.side_bytes = 0  # what a side run's cache may grow to
        self.store_capacity = total_bytes  # what the store may hold now
        self._store: BudgetedStore | None = None

    def attach(self, store: BudgetedStore) -> None:
        """Count ``store``'s bytes against this budget (one store per budget)."""
        if self._store is not None:
            raise ValueError("this KV budget already has its store")
        self._store = store

    @property
    def reserved_bytes(self) -> int:
        return self.running_bytes + self.side_bytes

    @property
    def stored_bytes(self) -> int:
        return self._store.num_bytes if self._store is not None else 0

    def fits_running(self, running_bytes: int) -> bool:
        """Whether the running sequences may reserve ``running_bytes`` in all, beside the side run."""
        return running_bytes + self.side_bytes <= self.total_bytes

    def reserve_running(self, running_bytes: int) -> None:
        """The running sequences now reserve ``running_bytes`` in all; the store evicts down to the rest."""
        if running_bytes < 0:
            raise ValueError(f"a reservation cannot be negative, got {running_bytes}")
        self.running_bytes = running_bytes
        self._lend_the_rest_to_the_store()

    def reserve_side(self, num_bytes: int) -> bool:
        """Room for a side run's cache (0: give it back); False if it does not fit now.

        The room must be free already, or small (a sixteenth of the budget at
        most): a check may cost the store its least recently used entries,
        but not a large share of what it holds.
        """
        if num_bytes:
            if self.running_bytes + num_bytes > self.total_bytes:
                return False
            free_now = self.running_bytes + self.stored_bytes + num_bytes <= self.total_bytes
            if not (free_now or num_bytes <= self.total_bytes // SIDE_EVICTION_SHARE):
                return False
        self.side_bytes = num_bytes
        self._lend_the_rest_to_the_store()
        return True

    def _lend_the_rest_to_the_store(self) -> None:
        rest = max(0, self.total_bytes - self.reserved_bytes)
        held = self._store.evict_down_to(rest) if self._store is not None else 0
        self.store_capacity = max(rest, held)
