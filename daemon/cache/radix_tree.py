"""The prefix store's radix tree: its node, walks, sizes and invariant checks.

Kept apart from prefix_store.py so that the store reads as its contract
(match, insert, pin, evict, stats) and these pieces can be read on their own.
Pure Python: payloads are opaque ``Segment``/``Snapshot`` objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from ..common_prefix import common_prefix_length
from .store_types import CHECKPOINT_KINDS, Segment, Snapshot

if TYPE_CHECKING:
    from .eviction import Ledger


def require(condition: bool, message: str) -> None:
    """Integrity checks raise even under ``python -O`` (unlike ``assert``)."""
    if not condition:
        raise AssertionError(message)


class Node:
    """A radix-tree node: the edge from its parent, its payload, its checkpoint.

    ``lock_count`` / ``pin_count`` count the leases / pins held on this node or
    on a descendant, so protecting a node protects its ancestors too.
    """

    __slots__ = (
        "ledger",
        "parent",
        "key",
        "segment",
        "snapshot",
        "next_logits",
        "kind",
        "children",
        "depth",
        "nbytes",
        "lock_count",
        "pin_count",
        "stored_at",
        "last_access",
        "heap_version",
    )

    def __init__(self, ledger: "Ledger", parent: Node | None, key: tuple[int, ...], segment: Any, now: float):
        self.ledger = ledger
        self.parent = parent  # None for a root, and for an evicted node
        self.key = key  # the edge's token ids; children are keyed by key[0]
        self.segment = segment  # attention KV of exactly the edge's tokens
        self.snapshot: Any = None
        self.next_logits: Any = None  # NextTokenLogits where a prompt ended here (PrefixStore.attach_logits)
        self.kind: str | None = None  # checkpoint kind at this depth, if any
        self.children: dict[int, Node] = {}
        self.depth = (parent.depth if parent else 0) + len(key)  # tokens from the root
        self.nbytes = 0  # segment + snapshot + next-token logits bytes, kept in step with the ledgers
        self.lock_count = 0
        self.pin_count = 0
        self.stored_at = now
        self.last_access = now
        self.heap_version = 0

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def start_depth(self) -> int:
        return self.depth - len(self.key)


def snapshot_nbytes(snapshot: Snapshot | None) -> int:
    return snapshot.nbytes if snapshot is not None else 0


def depth_payload_nbytes(node: Node) -> int:
    """What a node holds for its depth rather than its edge: the snapshot and the next-token logits."""
    return snapshot_nbytes(node.snapshot) + (node.next_logits.nbytes if node.next_logits is not None else 0)


def longest_head(segment: Segment, max_bytes: int) -> Segment | None:
    """The longest proper head of segment within max_bytes, if any.

    Splits may copy, so guess from the average token size first and search
    below the guess only if the segment is not uniform.
    """
    guess = min(segment.num_tokens - 1, segment.num_tokens * max_bytes // max(segment.nbytes, 1))
    if guess < 1:
        return None
    head = segment.split(guess)[0]
    if head.nbytes <= max_bytes:
        return head
    lo, hi, best = 1, guess - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        head = segment.split(mid)[0]
        if head.nbytes <= max_bytes:
            best, lo = head, mid + 1
        else:
            hi = mid - 1
    return best


def descendants(root: Node) -> Iterator[Node]:
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def walk(root: Node, tokens: tuple) -> tuple[list[Node], int]:
    """Follow tokens down: the nodes entered, and how many tokens agree.

    The last node entered may agree on only part of its edge.
    """
    path, node, depth = [], root, 0
    while depth < len(tokens):
        child = node.children.get(tokens[depth])
        if child is None:
            break
        path.append(child)
        if tokens[depth : child.depth] == child.key:
            node, depth = child, child.depth
            continue
        depth += common_prefix_length(child.key, tokens, depth)
        break
    return path, depth


def touch(root: Node, tokens: tuple, now: float) -> None:
    """Mark the nodes covering tokens (a stored prefix) as just used."""
    node = root
    while node.depth < len(tokens):
        node = node.children[tokens[node.depth]]
        node.last_access = now


def check_edges(node: Node, name: str) -> None:
    for first, child in node.children.items():
        where = f"{name!r}: child at depth {child.depth}"
        require(child.parent is node and child.ledger is node.ledger, f"{where}: misfiled")
        require(len(child.key) > 0 and child.key[0] == first, f"{where}: keyed {first}")
        require(child.depth == node.depth + len(child.key), f"{where}: depth inconsistent")


def check_payload(node: Node, name: str) -> None:
    where = f"{name!r}: node at depth {node.depth}"
    require(
        node.segment.num_tokens == len(node.key),
        f"{where}: segment holds {node.segment.num_tokens} tokens, edge {len(node.key)}",
    )
    require(
        node.nbytes == node.segment.nbytes + depth_payload_nbytes(node),
        f"{where}: {node.nbytes} bytes recorded, payload has other",
    )
    require(
        node.kind in CHECKPOINT_KINDS or (node.kind is None and node.snapshot is None),
        f"{where}: bad checkpoint {node.kind!r}",
    )
