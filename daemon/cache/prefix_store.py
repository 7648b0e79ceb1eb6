"""The global prefix-cache store: one radix tree of token ids per model namespace.

Each edge is labeled by a tuple of token ids and carries the attention KV of
exactly those tokens as an opaque ``Segment``; children are keyed by their
first token, so a lookup costs time linear in the prompt, not in the number
of entries, and a ten-turn chat stores each turn once. A node may carry a
checkpoint: a kind and, for hybrid models, a ``Snapshot`` of the
non-trimmable layers (conv/SSM state) at exactly that depth, the only depths
where such a model can resume. Budgets and eviction (eviction.py) are global
across namespaces.

Payloads are opaque: this module never imports mlx, and the unit tests drive
it with fakes. Only the engine thread uses the store, so it takes no locks;
"locking" a node here means a reference count that keeps it from eviction
while a running request reuses it.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, Iterator, NamedTuple

from .eviction import Budget, EvictionPolicy, Ledger, RecencyCostPolicy, RecomputeSeconds, default_recompute_seconds
from .kv_budget import KvBudget
from .lookup_counters import LookupCounters
from .radix_tree import (
    Node,
    check_edges,
    check_payload,
    depth_payload_nbytes,
    descendants,
    longest_head,
    require,
    snapshot_nbytes,
    touch,
    walk,
)
from .store_types import (  # noqa: F401 (re-exported for callers)
    CheckpointKind,
    CHECKPOINT_KINDS,
    HitKind,
    MissReason,
    Segment,
    Snapshot,
    Checkpoints,
    NextTokenLogits,
    PrefixStoreError,
    NotStored,
    PinBudgetExceeded,
    Lease,
    Match,
    InsertResult,
    PinResult,
    CacheStats,
    StoreStats,
    StoredEdge,
)


class _Namespace:
    def __init__(self, name: str, now: float):
        self.name = name
        self.ledger = Ledger()
        self.root = Node(self.ledger, None, (), None, now)
        self.pins: Counter[tuple[int, ...]] = Counter()
        self.lookups = LookupCounters()


class _Step(NamedTuple):
    """One unit of an insert, in depth order."""

    depth: int  # of the checkpoint, or where the new edge ends
    nbytes: int
    num_nodes: int
    kind: str | None
    snapshot: Snapshot | None
    segment: Segment | None  # None: a checkpoint for an already stored depth


class PrefixStore:
    """Radix trees of KV segments, one per namespace, under global budgets.

    ``max_bytes`` bounds stored payload bytes (a KvBudget: its store capacity,
    what running sequences leave), ``max_nodes`` the number of nodes,
    ``max_pinned_bytes`` the bytes of pinned paths. Eviction removes
    unlocked, unpinned leaves in the order of ``policy`` (default:
    RecencyCostPolicy built from ``recompute_seconds``, see eviction.py).
    """

    def __init__(
        self,
        max_bytes: int | KvBudget,
        max_nodes: int,
        max_pinned_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        recompute_seconds: RecomputeSeconds | None = None,
        policy: EvictionPolicy | None = None,
    ):
        if policy is not None and recompute_seconds is not None:
            raise ValueError("recompute_seconds only configures the default policy")
        policy = policy or RecencyCostPolicy(recompute_seconds or default_recompute_seconds)
        self.kv_budget = max_bytes if isinstance(max_bytes, KvBudget) else KvBudget(max_bytes)
        self.budget = Budget(self.kv_budget, max_nodes, max_pinned_bytes, policy)
        self.kv_budget.attach(self)
        self._clock = clock
        self._namespaces: dict[str, _Namespace] = {}
        self._lookups = LookupCounters()

    # ----- lookup -----

    def match(
        self,
        namespace: str,
        tokens,
        max_length: int | None = None,
        requires_snapshot: bool = False,
        whole_with_logits: bool = False,
    ) -> Match:
        """The longest usable stored prefix of tokens, at most max_length long.

        max_length defaults to len(tokens) - 1: one token must always be run.
        With requires_snapshot (hybrid models) only depths of nodes carrying a
        Snapshot are usable; otherwise any depth is, the last segment being a
        split head (the tree does not change). ``reason`` says why a hit is not
        exact: "empty" (nothing stored in the namespace), "diverged" (the
        nearest stored sequence differs from the prompt, or ends, at
        matched_tokens), "no-checkpoint" (hybrid: agreement went past the
        deepest snapshot), "max-length" (the cap). The used nodes stay locked
        until release(match.lease).

        With whole_with_logits, all of tokens is usable, past max_length, where
        a node ends exactly at their end and keeps next-token logits
        (attach_logits; and a snapshot if required): an exact repeat of a
        prompt, whose first answer token needs no pass. ``match.logits`` holds them.
        """
        tokens = tuple(tokens)
        max_length = max(0, min(len(tokens) - 1 if max_length is None else max_length, len(tokens)))
        ns = self._namespace(namespace)
        path, matched = walk(ns.root, tokens)
        end = path[-1] if path and matched == len(tokens) == path[-1].depth else None
        with_logits = (
            whole_with_logits
            and end is not None
            and end.next_logits is not None
            and (end.snapshot is not None or not requires_snapshot)
        )
        if with_logits:
            length, used = len(tokens), path
        else:
            length, used = self._usable(path, min(max_length, matched), requires_snapshot)
        now = self._clock()
        for node in used:
            node.last_access = now
        last = used[-1] if used else None
        at_length = last if last is not None and last.depth == length else None
        self.budget.lock(last)
        hit, reason = self._classify(ns, len(tokens), length, matched, max_length, path)
        for lookups in (ns.lookups, self._lookups):
            lookups.record(hit, length, len(tokens))
        return Match(
            length,
            matched,
            self._segments(used, length),
            snapshot=at_length.snapshot if at_length else None,
            checkpoint_kind=(at_length.kind if at_length else None) or "prefix",
            stored_at=last.stored_at if last else None,
            age_s=now - last.stored_at if last else None,
            hit=hit,
            reason=reason,
            lease=Lease(last),
            copied_tail_tokens=length - last.start_depth if last is not None and last.depth > length else 0,
            logits=end.next_logits if with_logits else None,
        )

    def lease(self, namespace: str, tokens) -> Lease:
        """Lock what is stored along ``tokens`` (its deepest node and the ancestors) until release().

        For a sequence being prefilled: what it stored so far must survive
        until it is done, or its next chunks would have nothing to hang from.
        Counts no lookup.
        """
        ns = self._namespaces.get(namespace)
        path = walk(ns.root, tuple(tokens))[0] if ns is not None else []
        node = path[-1] if path else None
        self.budget.lock(node)
        return Lease(node)

    def leased_segments(self, lease: Lease, length: int) -> tuple[Segment, ...] | None:
        """The stored segments covering exactly tokens [0, length) of what ``lease`` holds, root first.

        None when no node on the leased path ends at ``length`` (that would take
        a split, which copies) or the lease holds less. For a sequence whose
        prompt was just stored: it may read it from here instead of keeping a
        copy of its own. Counts no lookup and touches nothing.
        """
        if lease.released:
            raise ValueError("the lease was released")
        path = []
        node = lease.node
        while node is not None and node.parent is not None:  # the root has no parent and no segment
            path.append(node)
            node = node.parent
        covering = [node for node in reversed(path) if node.depth <= length]
        if length <= 0 or not covering or covering[-1].depth != length:
            return None
        return tuple(node.segment for node in covering)

    def attach_logits(self, namespace: str, tokens, logits: NextTokenLogits) -> bool:
        """Keep the model's logits for the token after ``tokens`` at the node ending exactly there.

        For a prompt just stored in full: an exact repeat then samples its
        first token from them (match's whole_with_logits). A node keeps the
        logits it has. Evicts to make room; False when nothing was attached
        (not stored, no node ends there, no room, or a pinned path's budget).
        """
        ns = self._namespaces.get(namespace)
        tokens = tuple(tokens)
        path, matched = walk(ns.root, tokens) if ns is not None else ([], 0)
        if not tokens or matched != len(tokens) or path[-1].depth != len(tokens):
            return False
        node = path[-1]
        if node.next_logits is not None:
            return True
        if node.pin_count and not self.budget.can_pin(logits.nbytes):
            return False
        self.budget.lock(node)  # making room must not evict the node itself
        try:
            has_room = self.budget.make_room(logits.nbytes, 0)
        finally:
            self.budget.unlock(node)
        if not has_room:
            return False
        node.next_logits = logits
        self.budget.resize(node, node.nbytes + logits.nbytes)
        self.budget.reconsider(node)  # its size, hence its eviction key, changed
        return True

    def release(self, lease: Lease) -> None:
        """Unlock what a match locked. Releasing twice is a bug and raises."""
        if lease.released:
            raise ValueError("lease already released")
        lease.released = True
        self.budget.unlock(lease.node)

    @staticmethod
    def _usable(path: list[Node], cap: int, requires_snapshot: bool) -> tuple[int, list[Node]]:
        """The reusable length (<= cap) and the nodes whose tokens it covers."""
        if not requires_snapshot:
            return cap, [node for node in path if node.start_depth < cap]
        for i in range(len(path) - 1, -1, -1):
            if path[i].depth <= cap and path[i].snapshot is not None:
                return path[i].depth, path[: i + 1]
        return 0, []

    @staticmethod
    def _segments(used: list[Node], length: int) -> tuple[Segment, ...]:
        segments = [node.segment for node in used]
        if used and used[-1].depth > length:
            segments[-1] = used[-1].segment.split(length - used[-1].start_depth)[0]
        return tuple(segments)

    @staticmethod
    def _classify(
        ns: _Namespace, num_tokens: int, length: int, matched: int, max_length: int, path: list[Node]
    ) -> tuple[HitKind, MissReason | None]:
        if length > 0 and (length == num_tokens or length == max_length >= num_tokens - 1):
            return "exact", None
        hit: HitKind = "partial" if length > 0 else "miss"
        if not ns.root.children:
            return hit, "empty"
        if length < min(max_length, matched):
            return hit, "no-checkpoint"
        if max_length < matched:
            return hit, "max-length"
        # "extends": the prompt goes on past the end of a stored sequence (the
        # usual next chat turn); "diverged": it disagrees with stored tokens.
        ends_stored = bool(path) and path[-1].depth == matched and not path[-1].children
        return hit, "extends" if ends_stored else "diverged"

    # ----- insert -----

    def insert(
        self,
        namespace: str,
        tokens,
        segment_start: int,
        segment: Segment | None,
        checkpoints: Checkpoints | None = None,
    ) -> InsertResult:
        """Store tokens; ``segment`` holds the KV of tokens[segment_start:].

        Tokens already stored are not stored again (segment is split to keep
        the new tail). A checkpoint at a stored depth is attached if that node
        has none, or has no snapshot and the new one does (an edge is split to
        make a node there if needed). Evicts to make room; what cannot fit even
        then is cut off, storing the longest prefix that fits: ending at any
        token, or at a checkpoint depth when the insert carries snapshots (a
        hybrid model resumes only at snapshots). reason: "budget" for that,
        "gap" when segment_start lies beyond what is stored.
        """
        tokens, checkpoints = tuple(tokens), dict(checkpoints or {})
        self._check_insert_args(tokens, segment_start, segment, checkpoints)
        ns = self._namespace(namespace)
        path, num_present = walk(ns.root, tokens)
        anchor = path[-1] if path else None
        mid_edge = anchor is not None and anchor.depth > num_present
        num_evictions = self.budget.total.num_evictions
        self.budget.lock(anchor)  # what we attach to must survive the evictions below
        try:
            steps = self._plan_attachments(path, num_present, checkpoints)
            edges = self._plan_new_edges(tokens, num_present, segment_start, segment, checkpoints)
            if edges and mid_edge and not any(s.depth == num_present for s in steps):
                edges[0] = edges[0]._replace(num_nodes=2)  # the divergence point splits an edge
            steps += edges
            self.budget.make_room(sum(s.nbytes for s in steps), sum(s.num_nodes for s in steps))
            allow_partial = not any(snapshot for _, snapshot in checkpoints.values())
            taken, complete = self._fit(steps, allow_partial)
            now = self._clock()
            stored_tokens, stored_bytes = self._apply(ns, tokens, taken, now)
            touch(ns.root, tokens[:num_present], now)  # after _apply: splits make new nodes
        finally:
            self.budget.unlock(anchor)
        reason = None if complete else "budget"
        if segment_start > num_present < len(tokens):
            reason = "gap"
        num_evicted = self.budget.total.num_evictions - num_evictions
        return InsertResult(stored_tokens, stored_bytes, num_evicted, reason)

    @staticmethod
    def _check_insert_args(
        tokens: tuple, segment_start: int, segment: Segment | None, checkpoints: Checkpoints
    ) -> None:
        if not 0 <= segment_start <= len(tokens):
            raise ValueError(f"segment_start {segment_start} outside [0, {len(tokens)}]")
        if (segment.num_tokens if segment else 0) != len(tokens) - segment_start:
            raise ValueError(
                f"segment must cover the {len(tokens) - segment_start} tokens from segment_start {segment_start}"
            )
        for depth, (kind, _) in checkpoints.items():
            if not 0 < depth <= len(tokens) or kind not in CHECKPOINT_KINDS:
                raise ValueError(f"bad checkpoint {kind!r} at depth {depth} of a {len(tokens)}-token sequence")

    @staticmethod
    def _plan_attachments(path: list[Node], num_present: int, checkpoints: Checkpoints) -> list[_Step]:
        """Checkpoints for depths already stored, where they add something."""
        by_depth = {node.depth: node for node in path}
        steps = []
        for depth in sorted(d for d in checkpoints if d <= num_present):
            kind, snapshot = checkpoints[depth]
            node = by_depth.get(depth)
            if node is not None and node.kind is not None and (snapshot is None or node.snapshot is not None):
                continue  # a node keeps the checkpoint it has
            steps.append(_Step(depth, snapshot_nbytes(snapshot), 0 if node else 1, kind, snapshot, None))
        return steps

    @staticmethod
    def _plan_new_edges(
        tokens: tuple, num_present: int, segment_start: int, segment: Segment | None, checkpoints: Checkpoints
    ) -> list[_Step]:
        """New edges below num_present, cut at the checkpoint depths."""
        if segment is None or segment_start > num_present or num_present == len(tokens):
            return []
        tail = segment
        if num_present > segment_start:
            tail = segment.split(num_present - segment_start)[1]
        ends = sorted(d for d in checkpoints if num_present < d < len(tokens)) + [len(tokens)]
        steps, start = [], num_present
        for end in ends:
            piece = tail
            if end < len(tokens):
                piece, tail = tail.split(end - start)
            kind, snapshot = checkpoints.get(end, (None, None))
            steps.append(_Step(end, piece.nbytes + snapshot_nbytes(snapshot), 1, kind, snapshot, piece))
            start = end
        return steps

    def _fit(self, steps: list[_Step], allow_partial: bool) -> tuple[list[_Step], bool]:
        """The longest prefix of steps the budget allows now; True if all fit."""
        free_bytes, free_nodes = self.budget.free_bytes, self.budget.free_nodes
        taken = []
        for step in steps:
            if step.nbytes <= free_bytes and step.num_nodes <= free_nodes:
                taken.append(step)
                free_bytes, free_nodes = free_bytes - step.nbytes, free_nodes - step.num_nodes
                continue
            if allow_partial and step.segment is not None and step.num_nodes <= free_nodes:
                head = longest_head(step.segment, free_bytes)
                if head is not None:
                    depth = step.depth - step.segment.num_tokens + head.num_tokens
                    taken.append(_Step(depth, head.nbytes, step.num_nodes, None, None, head))
            return taken, False
        return taken, True

    def _apply(self, ns: _Namespace, tokens: tuple, steps: list[_Step], now: float) -> tuple[int, int]:
        """Carry out fitted steps; return (tokens stored, bytes stored)."""
        stored_tokens = stored_bytes = 0
        parent = None
        for step in steps:
            if step.segment is None:
                node = self._node_at(ns.root, tokens, step.depth)
                stored_bytes += self._set_checkpoint(node, step.kind, step.snapshot)
                continue
            if parent is None:
                parent = self._node_at(ns.root, tokens, step.depth - step.segment.num_tokens)
            parent = self._add_child(parent, tokens[parent.depth : step.depth], step, now)
            stored_tokens, stored_bytes = stored_tokens + parent.num_tokens, stored_bytes + step.nbytes
        if parent is not None:
            self.budget.reconsider(parent)
        return stored_tokens, stored_bytes

    def _set_checkpoint(self, node: Node, kind: str, snapshot: Snapshot | None) -> int:
        """Give node a checkpoint; return the bytes added."""
        node.kind = node.kind or kind
        if snapshot is None or node.snapshot is not None:
            return 0
        if node.pin_count and not self.budget.can_pin(snapshot.nbytes):
            return 0  # the pinned path would break the pin budget: go without the snapshot
        node.snapshot = snapshot
        self.budget.resize(node, node.nbytes + snapshot.nbytes)
        return snapshot.nbytes

    # ----- pins -----

    def pin(self, namespace: str, tokens) -> PinResult:
        """Keep a fully stored sequence from eviction until unpin().

        Raises NotStored if it is not stored, PinBudgetExceeded if its
        not-yet-pinned bytes would push pinned bytes past max_pinned_bytes.
        Pins count: pinning twice needs two unpins.
        """
        tokens = tuple(tokens)
        if not tokens:
            raise ValueError("cannot pin an empty sequence")
        ns = self._namespaces.get(namespace)
        path, num_present = walk(ns.root, tokens) if ns else ([], 0)
        if num_present < len(tokens):
            raise NotStored(f"only {num_present} of these {len(tokens)} tokens are stored in namespace {namespace!r}")
        end = path[-1]
        end_bytes = end.nbytes
        if end.depth > len(tokens):  # it ends inside an edge: only the head gets pinned
            end_bytes = end.segment.split(len(tokens) - end.start_depth)[0].nbytes
        added = sum(node.nbytes for node in path[:-1] if not node.pin_count)
        added += 0 if end.pin_count else end_bytes
        if not self.budget.can_pin(added):
            raise PinBudgetExceeded(
                f"pinning {added} more bytes would exceed max_pinned_bytes "
                f"({self.budget.total.pinned_bytes} of {self.budget.max_pinned_bytes} pinned)"
            )
        if end.depth > len(tokens):
            end = self._split_for_pin(ns, tokens, end)
        self.budget.pin(end, +1)
        ns.pins[tokens] += 1
        return PinResult(len(tokens), self.budget.total.pinned_bytes, added)

    def unpin(self, namespace: str, tokens) -> PinResult:
        """Undo one pin() of tokens; raises NotStored if they are not pinned."""
        tokens = tuple(tokens)
        ns = self._namespaces.get(namespace)
        if ns is None or not ns.pins[tokens]:
            raise NotStored(f"these {len(tokens)} tokens are not pinned in {namespace!r}")
        ns.pins[tokens] -= 1
        if not ns.pins[tokens]:
            del ns.pins[tokens]
        pinned_before = self.budget.total.pinned_bytes
        # A pinned node cannot be evicted, and splits keep a node at its depth.
        self.budget.pin(self._node_at(ns.root, tokens, len(tokens)), -1)
        pinned = self.budget.total.pinned_bytes
        return PinResult(len(tokens), pinned, pinned_before - pinned)

    def _split_for_pin(self, ns: _Namespace, tokens: tuple, end: Node) -> Node:
        self.budget.lock(end)
        try:
            has_room = self.budget.make_room(0, 1)
        finally:
            self.budget.unlock(end)
        if not has_room:
            raise PinBudgetExceeded(
                "max_nodes reached and nothing evictable: no node can be made where the pinned sequence ends"
            )
        return self._node_at(ns.root, tokens, len(tokens))

    # ----- eviction and namespaces -----

    def evict(self, num_bytes: int) -> int:
        """Evict unlocked, unpinned leaves until num_bytes are freed; return bytes freed."""
        return self.budget.evict(num_bytes)

    def evict_down_to(self, max_bytes: int) -> int:
        """Evict until at most ``max_bytes`` are held, as far as leases and pins allow; return the bytes held."""
        if self.budget.total.num_bytes > max_bytes:
            self.budget.evict(self.budget.total.num_bytes - max_bytes)
        return self.budget.total.num_bytes

    def drop_namespace(self, namespace: str) -> None:
        """Forget a namespace, pins and leases included (releasing those still works)."""
        ns = self._namespaces.pop(namespace, None)
        if ns is not None:
            self.budget.close(ns.ledger)

    def _namespace(self, name: str) -> _Namespace:
        ns = self._namespaces.get(name)
        if ns is None:
            ns = self._namespaces[name] = _Namespace(name, self._clock())
        return ns

    # ----- tree mechanics -----

    def _node_at(self, root: Node, tokens: tuple, depth: int) -> Node:
        """The node at exactly depth along tokens (stored that far), splitting an edge if needed."""
        node = root
        while node.depth < depth:
            child = node.children[tokens[node.depth]]
            if child.depth > depth:
                return self._split(child, depth - child.start_depth)
            node = child
        return node

    def _split(self, node: Node, n: int) -> Node:
        """Cut node's edge after n tokens; return the new upper node."""
        head, tail = node.segment.split(n)
        upper = Node(node.ledger, node.parent, node.key[:n], head, node.stored_at)
        upper.last_access = node.last_access
        # Every lease and pin through node also runs through upper.
        upper.lock_count, upper.pin_count = node.lock_count, node.pin_count
        upper.children[node.key[n]] = node
        node.parent.children[node.key[0]] = upper
        node.parent, node.key, node.segment = upper, node.key[n:], tail
        self.budget.count_node(upper, +1)
        self.budget.resize(upper, head.nbytes)
        self.budget.resize(node, tail.nbytes + depth_payload_nbytes(node))
        self.budget.reconsider(node)  # its size and start, hence its key, changed
        return upper

    def _add_child(self, parent: Node, key: tuple, step: _Step, now: float) -> Node:
        child = Node(parent.ledger, parent, key, step.segment, now)
        child.kind, child.snapshot = step.kind, step.snapshot
        parent.children[key[0]] = child
        self.budget.count_node(child, +1)
        self.budget.resize(child, step.nbytes)
        return child

    # ----- reporting -----

    @property
    def num_bytes(self) -> int:
        """Bytes stored now, all namespaces together (O(1), unlike stats())."""
        return self.budget.total.num_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes that fit before anything must be evicted."""
        return self.budget.free_bytes

    def edges(self, namespace: str) -> Iterator[StoredEdge]:
        """Every edge of a namespace's tree, each parent before its children (for export)."""
        ns = self._namespaces.get(namespace)
        if ns is None:
            return
        stack: list[tuple[Node, int | None]] = [(child, None) for child in ns.root.children.values()]
        while stack:
            node, parent_id = stack.pop()
            yield StoredEdge(
                id(node),
                parent_id,
                node.key,
                node.start_depth,
                node.kind,
                node.segment,
                node.snapshot,
                node.segment.nbytes + snapshot_nbytes(node.snapshot),
                node.last_access,
            )
            stack.extend((child, id(node)) for child in node.children.values())

    def stats(self) -> StoreStats:
        """Sizes and counters, globally and per namespace."""
        per_ns = {
            name: self._make_stats(ns.ledger, ns.lookups, sum(1 for n in descendants(ns.root) if not n.children))
            for name, ns in self._namespaces.items()
        }
        num_sequences = sum(s.num_sequences for s in per_ns.values())
        return StoreStats(self._make_stats(self.budget.total, self._lookups, num_sequences), per_ns)

    def _make_stats(self, ledger: Ledger, lookups: LookupCounters, num_sequences: int) -> CacheStats:
        budget = self.budget
        return CacheStats(
            ledger.num_nodes,
            num_sequences,
            ledger.num_bytes,
            budget.max_bytes,
            ledger.pinned_bytes,
            budget.max_pinned_bytes,
            lookups.by_hit["exact"],
            lookups.by_hit["partial"],
            lookups.by_hit["miss"],
            lookups.num_reused_tokens,
            lookups.num_lookup_tokens,
            ledger.num_evictions,
            *lookups.recent_rates(),
        )

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the store does not hold."""
        live_keys = self.budget.live_keys()
        counted = []
        for name, ns in self._namespaces.items():
            direct_pins = self._direct_pins(ns)
            self.budget.check_node(ns.root, direct_pins[id(ns.root)], live_keys)
            require(ns.root.parent is None and ns.root.depth == 0 and ns.root.nbytes == 0, f"{name!r}: bad root")
            nodes = list(descendants(ns.root))
            for node in [ns.root, *nodes]:
                check_edges(node, name)
            for node in nodes:
                check_payload(node, name)
                self.budget.check_node(node, direct_pins[id(node)], live_keys)
            counted.append(
                (
                    name,
                    ns.ledger,
                    (len(nodes), sum(n.nbytes for n in nodes), sum(n.nbytes for n in nodes if n.pin_count)),
                )
            )
        self.budget.check_totals(counted)

    def _direct_pins(self, ns: _Namespace) -> Counter[int]:
        """id(node) -> pins ending exactly at it."""
        direct: Counter[int] = Counter()
        for tokens, count in ns.pins.items():
            path, num_present = walk(ns.root, tokens)
            require(
                count > 0 and num_present == len(tokens) and path[-1].depth == len(tokens),
                f"{ns.name!r}: a pinned {len(tokens)}-token sequence lost its node",
            )
            direct[id(path[-1])] += count
        return direct
