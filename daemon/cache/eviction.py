"""Budgets and eviction for the prefix store.

A ``Budget`` counts every stored byte and node, globally and per namespace
(one ``Ledger`` each), against the store's limits. It protects the nodes that
leases (locks) and pins hold, with their ancestors, and to make room evicts
unprotected leaves in the order of a pluggable policy, smallest key first; a
parent whose last child goes becomes a leaf and a candidate in turn.

The heap keeps keys computed at push time, so a policy's key must depend only
on the node's own fields (last access, depth, size), never on the current
time; the store calls ``Budget.reconsider(node)`` whenever one of them changes.
Single-threaded, like the store.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Protocol

from .kv_budget import KvBudget
from .radix_tree import Node, require

MIB = 1024 * 1024

RecomputeSeconds = Callable[[int, int], float]
"""(start_depth, num_tokens) -> estimated seconds to prefill those tokens again."""


class Ledger:
    """Nodes, bytes, pinned bytes and evictions of one namespace, or of all."""

    __slots__ = ("num_nodes", "num_bytes", "pinned_bytes", "num_evictions", "closed")

    def __init__(self):
        self.num_nodes = self.num_bytes = self.pinned_bytes = self.num_evictions = 0
        self.closed = False  # the namespace was dropped: its nodes are gone


class EvictionPolicy(Protocol):
    """Orders evictable leaves: the smallest key is evicted first."""

    def key(self, node: Node) -> float: ...


def default_recompute_seconds(start_depth: int, num_tokens: int) -> float:
    """Rough prefill cost of tokens [start_depth, start_depth + num_tokens).

    Each token pays a fixed part plus attention over the context before it, so
    deep tokens cost more. The constants fit Qwen3-0.6B in float32 on this
    project's CPU (87 tok/s at 512 tokens, 40 tok/s at 2048); the engine should
    pass its own measurement.
    """
    mean_context = start_depth + num_tokens / 2
    return num_tokens * (7e-3 + 1.8e-5 * mean_context)


class LruPolicy:
    """Least recently used first: key = last_access."""

    def key(self, node: Node) -> float:
        return node.last_access


class RecencyCostPolicy:
    """Recency weighed against what a leaf would cost to compute again.

        key = last_access + weight * recompute_seconds(start_depth, num_tokens) / (nbytes / MiB)

    The smallest key is evicted first. ``recompute_seconds / MiB`` is the
    prefill time each byte of the leaf saves; ``weight`` (in MiB) turns it into
    seconds of recency. With the default weight of 60, a leaf saving 0.5 s of
    prefill per MiB it holds is kept as if it had been used 30 s later than it
    was. Deep leaves (attention over a long context) and leaves that are small
    for their tokens (hybrid models) thus outlive shallow, bulky ones used at
    the same time.
    """

    def __init__(self, recompute_seconds: RecomputeSeconds = default_recompute_seconds, weight: float = 60.0):
        if weight < 0:
            raise ValueError(f"weight must be >= 0, got {weight}")
        self.recompute_seconds = recompute_seconds
        self.weight = weight

    def key(self, node: Node) -> float:
        seconds = self.recompute_seconds(node.start_depth, node.num_tokens)
        return node.last_access + self.weight * seconds / (max(node.nbytes, 1) / MIB)


class EvictionHeap:
    """Evictable leaves by policy key, with lazy invalidation (as SGLang does).

    Each push bumps the node's ``heap_version``; an entry whose version is not
    the node's current one, or whose node is no longer evictable, is skipped
    when it surfaces. Entries are never deleted in place.
    """

    def __init__(self, policy: EvictionPolicy, is_evictable: Callable[[Node], bool]):
        self.policy = policy
        self._is_evictable = is_evictable
        self._entries: list[tuple[float, int, int, Node]] = []
        self._tiebreak = itertools.count()  # equal keys: first pushed, first out
        self._compact_at = 64

    def push(self, node: Node) -> None:
        """(Re)insert node with its current key; its older entries go stale."""
        node.heap_version += 1
        entry = (self.policy.key(node), next(self._tiebreak), node.heap_version, node)
        heapq.heappush(self._entries, entry)
        if len(self._entries) > self._compact_at:
            # Dropping entries of nodes that are not evictable now is safe:
            # they are pushed again when they become evictable.
            self._entries = [e for e in self._entries if self._is_live(e)]
            heapq.heapify(self._entries)
            self._compact_at = max(64, 2 * len(self._entries))

    def pop(self) -> Node | None:
        """The evictable leaf with the smallest key, or None if there is none."""
        while self._entries:
            entry = heapq.heappop(self._entries)
            if self._is_live(entry):
                return entry[3]
        return None

    def live_keys(self) -> dict[int, float]:
        """id(node) -> key of its live entry, for integrity checks."""
        return {id(e[3]): e[0] for e in self._entries if self._is_live(e)}

    def _is_live(self, entry: tuple[float, int, int, Node]) -> bool:
        return entry[2] == entry[3].heap_version and self._is_evictable(entry[3])


class Budget:
    """Global limits on bytes, nodes and pinned bytes, and eviction to keep them.

    The byte limit is the KV budget's store capacity (kv_budget.py), read
    whenever room is made: it shrinks while running sequences hold part of
    the budget.
    """

    def __init__(self, kv_budget: KvBudget, max_nodes: int, max_pinned_bytes: int, policy: EvictionPolicy):
        if max_nodes < 0 or not 0 <= max_pinned_bytes <= kv_budget.total_bytes:
            raise ValueError("need max_nodes >= 0 and 0 <= max_pinned_bytes <= max_bytes")
        self.kv_budget = kv_budget
        self.max_nodes = max_nodes
        self.max_pinned_bytes = max_pinned_bytes
        self.policy = policy
        self.total = Ledger()
        self._heap = EvictionHeap(policy, self.is_evictable)

    @property
    def max_bytes(self) -> int:
        return self.kv_budget.store_capacity

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self.total.num_bytes

    @property
    def free_nodes(self) -> int:
        return self.max_nodes - self.total.num_nodes

    def can_pin(self, num_bytes: int) -> bool:
        return self.total.pinned_bytes + num_bytes <= self.max_pinned_bytes

    # ----- accounting -----

    def count_node(self, node: Node, delta: int) -> None:
        """A node joined (+1) or left (-1) the tree."""
        node.ledger.num_nodes += delta
        self.total.num_nodes += delta

    def resize(self, node: Node, nbytes: int) -> None:
        """Set node's payload size, keeping every total in step."""
        delta, node.nbytes = nbytes - node.nbytes, nbytes
        for ledger in (node.ledger, self.total):
            ledger.num_bytes += delta
            ledger.pinned_bytes += delta if node.pin_count else 0

    def close(self, ledger: Ledger) -> None:
        """Forget a dropped namespace's nodes at once; their heap entries go stale."""
        ledger.closed = True
        self.total.num_nodes -= ledger.num_nodes
        self.total.num_bytes -= ledger.num_bytes
        self.total.pinned_bytes -= ledger.pinned_bytes

    # ----- protection -----

    @staticmethod
    def lock(node: Node | None) -> None:
        """Protect node and its ancestors until unlock(node)."""
        while node is not None:
            node.lock_count += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        deepest = node
        while node is not None:
            node.lock_count -= 1
            node = node.parent
        if deepest is not None:
            self.reconsider(deepest)

    def pin(self, node: Node, delta: int) -> None:
        """Add (+1) or remove (-1) a pin on node and its ancestors."""
        deepest = node
        while node is not None:
            if (node.pin_count == 0) != (node.pin_count + delta == 0):
                change = node.nbytes if delta > 0 else -node.nbytes
                node.ledger.pinned_bytes += change
                self.total.pinned_bytes += change
            node.pin_count += delta
            node = node.parent
        self.reconsider(deepest)

    # ----- eviction -----

    def is_evictable(self, node: Node) -> bool:
        return (
            node.parent is not None
            and not node.children
            and node.lock_count == 0
            and node.pin_count == 0
            and not node.ledger.closed
        )

    def reconsider(self, node: Node) -> None:
        """Queue node if it may be evicted: call wherever that or its key changed."""
        if self.is_evictable(node):
            self._heap.push(node)

    def make_room(self, num_bytes: int, num_nodes: int) -> bool:
        """Evict until num_bytes and num_nodes more fit; False if they cannot."""
        while num_bytes > self.free_bytes or num_nodes > self.free_nodes:
            node = self._heap.pop()
            if node is None:
                return False
            self._remove_leaf(node)
        return True

    def evict(self, num_bytes: int) -> int:
        """Evict leaves until num_bytes are freed or none is left; return bytes freed."""
        freed = 0
        while freed < num_bytes:
            node = self._heap.pop()
            if node is None:
                break
            freed += self._remove_leaf(node)
        return freed

    def _remove_leaf(self, node: Node) -> int:
        parent, nbytes = node.parent, node.nbytes
        del parent.children[node.key[0]]
        node.parent = None
        self.resize(node, 0)
        self.count_node(node, -1)
        node.ledger.num_evictions += 1
        self.total.num_evictions += 1
        self.reconsider(parent)  # it may just have become a leaf
        return nbytes

    # ----- integrity -----

    def check_node(self, node: Node, num_direct_pins: int, live_keys: dict[int, float]) -> None:
        """Protection counts add up, and an evictable leaf is queued with its current key."""
        where = f"node at depth {node.depth}"
        children = node.children.values()
        require(
            node.lock_count >= sum(c.lock_count for c in children) >= 0,
            f"{where}: lock count {node.lock_count} below its children's",
        )
        require(
            node.pin_count == num_direct_pins + sum(c.pin_count for c in children),
            f"{where}: pin count {node.pin_count} disagrees with the pins",
        )
        if self.is_evictable(node):
            require(
                live_keys.get(id(node)) == self.policy.key(node),
                f"{where}: evictable leaf missing from the eviction heap, or stale",
            )

    def live_keys(self) -> dict[int, float]:
        return self._heap.live_keys()

    def check_totals(self, ledgers: Iterable[tuple[str, Ledger, tuple[int, int, int]]]) -> None:
        """Ledgers equal what a walk of each tree counted (nodes, bytes, pinned
        bytes), the global ledger is their sum, and every limit holds."""
        summed = [0, 0, 0]
        for name, ledger, counted in ledgers:
            recorded = (ledger.num_nodes, ledger.num_bytes, ledger.pinned_bytes)
            require(
                counted == recorded,
                f"namespace {name!r}: counted (nodes, bytes, pinned) {counted}, recorded {recorded}",
            )
            summed = [a + b for a, b in zip(summed, counted)]
        total = self.total
        require(
            tuple(summed) == (total.num_nodes, total.num_bytes, total.pinned_bytes),
            "global totals drifted from the namespaces'",
        )
        require(total.num_nodes <= self.max_nodes, f"{total.num_nodes} nodes > {self.max_nodes}")
        require(total.num_bytes <= self.max_bytes, f"{total.num_bytes} bytes > {self.max_bytes}")
        require(
            total.pinned_bytes <= self.max_pinned_bytes, f"{total.pinned_bytes} pinned bytes > {self.max_pinned_bytes}"
        )
