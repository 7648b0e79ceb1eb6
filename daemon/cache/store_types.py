"""The prefix store's vocabulary: payload protocols, results, stats and errors.

Kept apart from prefix_store.py so the contract can be read on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, get_args

if TYPE_CHECKING:
    from .radix_tree import Node

CheckpointKind = Literal["chunk", "message", "prompt-end", "answer-end"]
CHECKPOINT_KINDS = frozenset(get_args(CheckpointKind))
HitKind = Literal["exact", "partial", "miss"]
MissReason = Literal["empty", "diverged", "extends", "no-checkpoint", "max-length"]
RECENT_WINDOW = 256


class Segment(Protocol):
    """Attention KV of consecutive tokens. ``split(n)`` (0 < n < num_tokens)
    returns (first n tokens, the rest) without altering self; the parts'
    nbytes should add up to self's, so splitting an edge keeps totals."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def split(self, n: int) -> tuple[Segment, Segment]: ...


class Snapshot(Protocol):
    """State of the non-trimmable layers at one depth."""

    @property
    def nbytes(self) -> int: ...


class NextTokenLogits(Protocol):
    """The model's logits for the token after one depth: kept where a prompt
    ended, so that an exact repeat of it samples its first answer token
    without running anything."""

    @property
    def nbytes(self) -> int: ...


Checkpoints = dict[int, tuple[str, "Snapshot | None"]]  # depth -> (kind, snapshot)


class PrefixStoreError(Exception):
    """Base of the store's refusals."""


class NotStored(PrefixStoreError):
    """The sequence is not (fully) stored, or is not pinned."""


class PinBudgetExceeded(PrefixStoreError):
    """Pinning would exceed max_pinned_bytes (or find no room for a node)."""


class Lease:
    """Keeps the nodes a match reuses from eviction until PrefixStore.release()."""

    __slots__ = ("node", "released")

    def __init__(self, node: "Node | None"):
        self.node = node
        self.released = False


@dataclass(frozen=True, slots=True)
class Match:
    """The longest usable stored prefix of a prompt; see PrefixStore.match()."""

    length: int  # reused tokens; segments cover exactly [0, length)
    matched_tokens: int  # where the prompt stops agreeing with the nearest stored sequence
    segments: tuple[Segment, ...]
    snapshot: Snapshot | None  # at length
    checkpoint_kind: str  # of the node at length, else "prefix"
    stored_at: float | None  # of the deepest node used
    age_s: float | None
    hit: HitKind
    reason: MissReason | None  # why not exact
    lease: Lease
    copied_tail_tokens: int = 0  # the last segment is a copy of part of a stored one, made for this match
    logits: NextTokenLogits | None = None  # at length == len(tokens): the whole prompt is stored with them


class InsertResult(NamedTuple):
    """What an insert added; ``reason`` ("budget", "gap") if not everything."""

    stored_tokens: int
    stored_bytes: int
    num_evicted: int
    reason: str | None


class PinResult(NamedTuple):
    """A pin or unpin: the tokens it covers, bytes pinned now, bytes it changed."""

    pinned_tokens: int
    pinned_bytes: int
    changed_bytes: int


class CacheStats(NamedTuple):
    """Sizes and counters, for the whole store or one namespace."""

    num_nodes: int
    num_sequences: int  # leaves
    num_bytes: int
    max_bytes: int
    pinned_bytes: int
    max_pinned_bytes: int
    num_hits: int
    num_partial_hits: int
    num_misses: int
    num_reused_tokens: int
    num_lookup_tokens: int
    num_evictions: int
    recent_hit_rate: float  # lookups that reused anything, over the last 256
    recent_reuse_ratio: float  # reused / looked-up tokens, over the last 256


class StoredEdge(NamedTuple):
    """One edge of a namespace's tree as ``PrefixStore.edges()`` hands it out.

    ``edge_id`` identifies the edge while it is stored; ``parent_id`` is its
    parent's (None: it hangs off the root). Payloads are the store's own
    objects: read them, never change them.
    """

    edge_id: int
    parent_id: int | None
    key: tuple[int, ...]  # the edge's tokens
    start_depth: int
    kind: str | None  # checkpoint kind at the edge's end
    segment: Segment
    snapshot: Snapshot | None
    nbytes: int  # segment + snapshot: what export writes (next-token logits are never written)
    last_access: float

    @property
    def depth(self) -> int:
        return self.start_depth + len(self.key)


class StoreStats(NamedTuple):
    total: CacheStats
    namespaces: dict[str, CacheStats]

    def as_dict(self) -> dict:
        """Plain nested dicts, ready to travel as a msgpack map."""
        return {"total": self.total._asdict(), "namespaces": {name: s._asdict() for name, s in self.namespaces.items()}}
