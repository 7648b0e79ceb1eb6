"""The prefix-cache store, driven by fake payloads that remember their token ids."""

from __future__ import annotations

import random

import pytest

from prefixd.daemon.cache.eviction import LruPolicy
from prefixd.daemon.cache import NotStored, PinBudgetExceeded, PrefixStore

BPT = 10  # bytes per token of a fake segment


class FakeSegment:
    """Holds the token ids whose KV it stands for, so tests can check exactly what a match returns."""

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return BPT * len(self.token_ids)

    def split(self, n: int):
        assert 0 < n < len(self.token_ids), (n, len(self.token_ids))
        return FakeSegment(self.token_ids[:n]), FakeSegment(self.token_ids[n:])


class FakeSnapshot:
    def __init__(self, depth: int, nbytes: int = 3):
        self.depth = depth
        self.nbytes = nbytes


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(clock):
    s = PrefixStore(max_bytes=10**6, max_nodes=10**4, max_pinned_bytes=10**5, clock=clock)
    yield s
    s.check_integrity()


def put(store, tokens, start=0, checkpoints=None, namespace="m"):
    tokens = list(tokens)
    segment = FakeSegment(tokens[start:]) if start < len(tokens) else None
    return store.insert(namespace, tokens, start, segment, checkpoints)


def covered(match) -> list[int]:
    """The token ids whose KV the match handed out, in order."""
    ids = [t for segment in match.segments for t in segment.token_ids]
    assert len(ids) == match.length
    return ids


def lookup(store, tokens, namespace="m", **kwargs):
    """match() then release(): for tests that only look."""
    match = store.match(namespace, tokens, **kwargs)
    store.release(match.lease)
    return match


A = list(range(1, 33))  # 32 tokens


# ----- match -----

def test_match_on_empty_store_is_a_miss(store):
    m = store.match("m", [1, 2, 3])
    assert (m.length, m.matched_tokens, m.segments, m.hit, m.reason) == (0, 0, (), "miss", "empty")
    assert (m.snapshot, m.checkpoint_kind, m.stored_at, m.age_s) == (None, "prefix", None, None)
    store.release(m.lease)


def test_exact_hit_reuses_all_but_the_last_token(store, clock):
    put(store, A[:10])
    clock.now += 5
    m = lookup(store, A[:10])
    assert (m.hit, m.reason, m.length, m.matched_tokens) == ("exact", None, 9, 10)
    assert covered(m) == A[:9]
    assert m.age_s == 5 and m.stored_at == 1000.0


@pytest.mark.parametrize("k", [1, 2, 7, 8, 9, 15, 16, 31])
def test_partial_hit_returns_exactly_the_agreeing_tokens(store, k):
    put(store, A)
    put(store, A[:8] + [900, 901, 902])  # a node at depth 8, so k crosses an edge boundary
    num_nodes = store.stats().total.num_nodes
    m = lookup(store, A[:k] + [-1, -2, -3])
    assert (m.length, m.matched_tokens, m.hit, m.reason) == (k, k, "partial", "diverged")
    assert covered(m) == A[:k]
    assert store.stats().total.num_nodes == num_nodes  # a mid-edge match does not split the tree
    # the head of an edge cut for this match is a copy: a fork reading it in place must still count it
    assert m.copied_tail_tokens == (0 if k in (8, len(A)) else k - (8 if k > 8 else 0))


def test_matched_tokens_is_the_divergence_index_even_past_max_length(store):
    put(store, A)
    m = lookup(store, A[:20] + [777] * 5, max_length=10)
    assert (m.length, m.matched_tokens, m.hit, m.reason) == (10, 20, "partial", "max-length")
    assert covered(m) == A[:10]


def test_prompt_extending_the_stored_sequence_reuses_all_of_it(store):
    put(store, A[:10])
    m = lookup(store, A[:10] + [5, 6, 7])
    assert (m.length, m.matched_tokens, m.hit, m.reason) == (10, 10, "partial", "extends")
    assert covered(m) == A[:10]


def test_one_token_prompt_never_reuses_anything(store):
    put(store, A[:4])
    m = lookup(store, A[:1])
    assert (m.length, m.hit, m.reason) == (0, "miss", "max-length")


def test_hybrid_match_uses_only_snapshot_depths(store):
    snaps = {d: FakeSnapshot(d) for d in (4, 8, 12)}
    put(store, A[:12], checkpoints={4: ("chunk", snaps[4]), 8: ("message", snaps[8]),
                                    12: ("answer-end", snaps[12])})
    m = lookup(store, A[:10] + [99, 98], requires_snapshot=True)
    assert (m.length, m.matched_tokens, m.reason, m.hit) == (8, 10, "no-checkpoint", "partial")
    assert m.snapshot is snaps[8] and m.checkpoint_kind == "message"
    assert covered(m) == A[:8]
    m = lookup(store, A[:6] + [0], requires_snapshot=True)
    assert (m.length, m.snapshot) == (4, snaps[4])
    m = lookup(store, A[:3] + [0], requires_snapshot=True)
    assert (m.length, m.hit, m.reason, m.segments) == (0, "miss", "no-checkpoint", ())
    m = lookup(store, A[:13], requires_snapshot=True)
    assert (m.hit, m.length, m.snapshot, m.checkpoint_kind) == ("exact", 12, snaps[12], "answer-end")
    # Without the snapshot requirement any depth is usable.
    m = lookup(store, A[:10] + [99])
    assert (m.length, m.snapshot, m.checkpoint_kind) == (10, None, "prefix")


# ----- insert -----

def test_inserting_the_same_sequence_twice_stores_nothing_new(store):
    first = put(store, A, checkpoints={16: ("message", None)})
    before = store.stats().total
    second = put(store, A, checkpoints={16: ("message", None)})
    assert (first.stored_tokens, first.stored_bytes) == (32, 32 * BPT)
    assert (second.stored_tokens, second.stored_bytes, second.reason) == (0, 0, None)
    after = store.stats().total
    assert (after.num_bytes, after.num_nodes) == (before.num_bytes, before.num_nodes)


def test_insert_keeps_only_the_new_tail_of_a_longer_segment(store):
    put(store, A[:20])
    result = put(store, A, start=5)  # the engine recomputed tokens 5..31
    assert (result.stored_tokens, result.stored_bytes) == (12, 12 * BPT)
    assert store.stats().total.num_bytes == 32 * BPT
    assert covered(lookup(store, A + [0])) == A


def test_ten_turn_chat_stores_each_turn_once(store):
    history: list[int] = []
    for turn in range(10):
        prompt = history + [turn * 1000 + i for i in range(50)]
        m = store.match("m", prompt)
        assert m.length == len(history)
        assert covered(m) == history
        full = prompt + [turn * 1000 + 500 + i for i in range(30)]
        result = store.insert("m", full, m.length, FakeSegment(full[m.length:]),
                              {len(prompt): ("prompt-end", None), len(full): ("answer-end", None)})
        store.release(m.lease)
        assert result.stored_tokens == 80
        history = full
        stats = store.stats().total
        assert stats.num_bytes == len(history) * BPT  # linear: no turn stored twice
        assert stats.num_sequences == 1
        store.check_integrity()


def test_sessions_sharing_a_system_prompt_store_it_once(store):
    system = [7] * 40
    put(store, system + list(range(100, 120)))
    put(store, system + list(range(200, 220)))
    stats = store.stats().total
    assert stats.num_bytes == (40 + 20 + 20) * BPT
    assert (stats.num_sequences, stats.num_nodes) == (2, 3)
    m = lookup(store, system + list(range(200, 220)) + [1])
    assert covered(m) == system + list(range(200, 220))


def test_checkpoint_at_a_stored_depth_splits_the_edge_and_attaches(store):
    put(store, A[:12])
    snap = FakeSnapshot(6, nbytes=5)
    result = store.insert("m", A[:12], 12, None, {6: ("message", snap)})
    assert (result.stored_tokens, result.stored_bytes) == (0, 5)
    assert store.stats().total.num_nodes == 2
    m = lookup(store, A[:8] + [0], requires_snapshot=True)
    assert (m.length, m.snapshot, m.checkpoint_kind) == (6, snap, "message")
    # A node keeps the checkpoint it has.
    store.insert("m", A[:12], 12, None, {6: ("chunk", FakeSnapshot(6))})
    assert lookup(store, A[:8] + [0], requires_snapshot=True).snapshot is snap


def test_insert_that_cannot_fit_stores_the_longest_prefix_that_does(clock):
    store = PrefixStore(max_bytes=20 * BPT, max_nodes=100, max_pinned_bytes=0, clock=clock)
    result = put(store, A)
    assert (result.stored_tokens, result.stored_bytes, result.reason) == (20, 20 * BPT, "budget")
    assert covered(lookup(store, A)) == A[:20]
    store.check_integrity()


def test_hybrid_insert_is_cut_at_a_snapshot_depth(clock):
    store = PrefixStore(max_bytes=20 * BPT, max_nodes=100, max_pinned_bytes=0, clock=clock)
    snaps = {d: ("chunk", FakeSnapshot(d, nbytes=1)) for d in (8, 16, 24)}
    result = put(store, A, checkpoints=snaps)
    assert (result.stored_tokens, result.stored_bytes, result.reason) == (16, 16 * BPT + 2, "budget")
    assert lookup(store, A, requires_snapshot=True).length == 16
    store.check_integrity()


def test_insert_beyond_the_stored_prefix_reports_a_gap(store):
    put(store, A[:10])
    result = put(store, A, start=20)
    assert (result.stored_tokens, result.reason) == (0, "gap")
    assert store.stats().total.num_bytes == 10 * BPT


@pytest.mark.parametrize("args", [
    (A[:4], 0, FakeSegment(A[:3]), None),  # segment too short
    (A[:4], 5, None, None),  # segment_start past the end
    (A[:4], 0, FakeSegment(A[:4]), {0: ("chunk", None)}),  # depth 0
    (A[:4], 0, FakeSegment(A[:4]), {5: ("chunk", None)}),  # past the end
    (A[:4], 0, FakeSegment(A[:4]), {2: ("lunch", None)}),  # unknown kind
])
def test_insert_rejects_inconsistent_arguments(store, args):
    with pytest.raises(ValueError):
        store.insert("m", *args)
    assert store.stats().total.num_bytes == 0


# ----- locks, pins, eviction -----

def test_locked_nodes_survive_eviction_until_released(store):
    put(store, A)
    put(store, [500 + t for t in A])
    m = store.match("m", A)
    assert store.evict(10**9) == 32 * BPT  # only the unlocked sequence went
    assert covered(store.match("m", A)) == A[:31]
    store.release(m.lease)
    with pytest.raises(ValueError):
        store.release(m.lease)
    assert store.evict(10**9) == 0  # the second match still holds it
    store.check_integrity()


def test_insert_evicts_others_but_never_a_locked_prefix(clock):
    store = PrefixStore(max_bytes=40 * BPT, max_nodes=100, max_pinned_bytes=0, clock=clock)
    put(store, A)
    m = store.match("m", A)
    result = put(store, [500 + t for t in A])
    assert (result.stored_tokens, result.num_evicted, result.reason) == (8, 0, "budget")
    store.release(m.lease)
    result = put(store, [500 + t for t in A])
    assert (result.stored_tokens, result.num_evicted, result.reason) == (24, 1, None)
    assert lookup(store, A).length == 0
    store.check_integrity()


def test_pinned_sequences_survive_eviction_until_unpinned(store):
    put(store, A)
    put(store, [500 + t for t in A])
    result = store.pin("m", A[:10])  # ends inside an edge: only the head is pinned
    assert result == (10, 10 * BPT, 10 * BPT)
    assert store.evict(10**9) == 54 * BPT
    assert covered(lookup(store, A + [0])) == A[:10]
    assert store.unpin("m", A[:10]) == (10, 0, 10 * BPT)
    assert store.evict(10**9) == 10 * BPT
    assert store.stats().total.num_nodes == 0


def test_pins_count_and_overlapping_pins_share_bytes(store):
    put(store, A)
    store.pin("m", A)
    store.pin("m", A)
    assert store.pin("m", A[:16]).changed_bytes == 0  # already pinned through A
    store.unpin("m", A)
    store.unpin("m", A[:16])
    assert store.evict(10**9) == 0  # one pin of A remains
    store.unpin("m", A)
    assert store.evict(10**9) == 32 * BPT


def test_pin_budget_and_not_stored_are_refused_clearly(clock):
    store = PrefixStore(max_bytes=10**6, max_nodes=100, max_pinned_bytes=15 * BPT, clock=clock)
    put(store, A)
    put(store, [500 + t for t in A])
    store.pin("m", A[:10])
    with pytest.raises(PinBudgetExceeded, match="max_pinned_bytes"):
        store.pin("m", [500 + t for t in A[:10]])
    assert store.pin("m", A[:15]).changed_bytes == 5 * BPT  # shares the first 10
    with pytest.raises(NotStored):
        store.pin("m", A + [0])
    with pytest.raises(NotStored):
        store.pin("other", A[:3])
    with pytest.raises(NotStored):
        store.unpin("m", A[:3])
    assert store.stats().total.pinned_bytes == 15 * BPT
    store.check_integrity()


def test_a_snapshot_that_would_break_the_pin_budget_is_not_attached(clock):
    store = PrefixStore(max_bytes=10**6, max_nodes=100, max_pinned_bytes=10 * BPT, clock=clock)
    put(store, A[:10])
    store.pin("m", A[:10])
    result = store.insert("m", A[:10], 10, None, {10: ("message", FakeSnapshot(10, nbytes=1))})
    assert result.stored_bytes == 0
    assert store.stats().total.pinned_bytes == 10 * BPT
    assert lookup(store, A[:10] + [0], requires_snapshot=True).length == 0
    store.unpin("m", A[:10])
    store.insert("m", A[:10], 10, None, {10: ("message", FakeSnapshot(10, nbytes=1))})
    assert lookup(store, A[:10] + [0], requires_snapshot=True).length == 10
    store.check_integrity()


def test_eviction_removes_parents_once_their_children_are_gone(store):
    system = [7] * 40
    put(store, system + [1, 2, 3])
    put(store, system + [4, 5, 6])
    assert store.evict(10**9) == 46 * BPT
    stats = store.stats()
    assert (stats.total.num_nodes, stats.total.num_bytes, stats.total.num_evictions) == (0, 0, 3)


def test_lru_policy_evicts_the_least_recently_used_leaf(clock):
    store = PrefixStore(10**6, 100, 0, clock=clock, policy=LruPolicy())
    for first in (100, 200, 300):
        put(store, [first, 1, 2, 3])
        clock.now += 1
    lookup(store, [100, 1, 2, 3])  # 100 is now the most recent
    store.evict(1)
    assert [lookup(store, [f, 1, 2, 3]).length for f in (100, 200, 300)] == [3, 0, 3]
    store.check_integrity()


def test_default_policy_keeps_costly_leaves_longer(clock):
    store = PrefixStore(10**6, 100, 0, clock=clock,
                        recompute_seconds=lambda start, n: n * (1 + start))
    put(store, [8, 1, 2, 3])  # shallow leaf
    put(store, [7] * 100 + [1, 2, 3, 4])
    put(store, [7] * 100 + [5, 6, 7, 8])  # two deep leaves of the same size: dear to recompute
    assert store.evict(1) == 4 * BPT
    assert lookup(store, [8, 1, 2, 3, 0]).length == 0
    assert lookup(store, [7] * 100 + [1, 2, 3, 4, 0]).length == 104
    store.check_integrity()


def test_max_nodes_is_never_exceeded(clock):
    store = PrefixStore(10**6, max_nodes=5, max_pinned_bytes=0, clock=clock)
    for i in range(20):
        put(store, [i, 1, 2, 3])
        assert store.stats().total.num_nodes <= 5
        assert lookup(store, [i, 1, 2, 3]).length == 3  # the newest always stays
        store.check_integrity()
    result = put(store, A, checkpoints={d: ("chunk", None) for d in range(4, 32, 4)})
    assert (result.stored_tokens, result.reason) == (20, "budget")  # 5 edges of 4 tokens
    store.check_integrity()


# ----- namespaces, stats, integrity -----

def test_namespaces_never_match_across(store):
    put(store, A, namespace="qwen")
    m = lookup(store, A, namespace="lfm")
    assert (m.length, m.reason) == (0, "empty")
    put(store, A[:16], namespace="lfm")
    assert lookup(store, A, namespace="lfm").length == 16
    store.drop_namespace("qwen")
    assert lookup(store, A, namespace="qwen").reason == "empty"
    assert lookup(store, A, namespace="lfm").length == 16
    assert store.stats().total.num_bytes == 16 * BPT


def test_releasing_a_lease_of_a_dropped_namespace_is_harmless(store):
    put(store, A, namespace="x")
    m = store.match("x", A)
    store.drop_namespace("x")
    store.release(m.lease)
    assert store.stats().total.num_nodes == 0


def test_stats_count_lookups_reuse_and_evictions(store):
    lookup(store, A)  # miss: empty
    put(store, A[:10])
    lookup(store, A[:10])  # exact: 9 reused
    lookup(store, A[:5] + [0, 0])  # partial: 5 reused
    put(store, A[:4] + [0], namespace="other")
    store.evict(10**9)
    stats = store.stats()
    m = stats.namespaces["m"]
    assert (m.num_misses, m.num_hits, m.num_partial_hits) == (1, 1, 1)
    assert (m.num_reused_tokens, m.num_lookup_tokens) == (14, 32 + 10 + 7)
    assert (m.num_evictions, stats.namespaces["other"].num_evictions) == (1, 1)
    assert stats.total.num_evictions == 2 and stats.total.num_hits == 1
    assert m.recent_hit_rate == pytest.approx(2 / 3)
    assert stats.as_dict()["namespaces"]["m"]["num_hits"] == 1


def test_recent_hit_rate_covers_only_the_last_256_lookups(store):
    put(store, A)
    for _ in range(100):
        lookup(store, [0, 1])
    for _ in range(200):
        lookup(store, A)
    total = store.stats().total
    assert total.recent_hit_rate == pytest.approx(200 / 256)
    assert total.recent_reuse_ratio == pytest.approx(200 * 31 / (56 * 2 + 200 * 32))
    assert (total.num_misses, total.num_hits) == (100, 200)


def test_check_integrity_catches_drifted_totals_and_stale_heap_entries(store):
    put(store, A)
    store.check_integrity()
    store.budget.total.num_bytes += 1
    with pytest.raises(AssertionError, match="global totals"):
        store.check_integrity()
    store.budget.total.num_bytes -= 1
    leaf = next(iter(store._namespaces["m"].root.children.values()))
    leaf.last_access += 1  # changed behind the heap's back
    with pytest.raises(AssertionError, match="eviction heap"):
        store.check_integrity()
    store.budget.reconsider(leaf)


# ----- churn -----

@pytest.mark.parametrize("seed", range(6))
def test_churn_under_a_small_budget_keeps_every_invariant(clock, seed):
    rng = random.Random(seed)
    store = PrefixStore(max_bytes=300 * BPT, max_nodes=30, max_pinned_bytes=60 * BPT, clock=clock)
    known: list[tuple[str, list[int]]] = []
    leases, pins = [], []
    for _ in range(400):
        clock.now += rng.random()
        namespace = rng.choice("ab")
        base = rng.choice(known)[1] if known and rng.random() < 0.7 else []
        tokens = base[:rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 40))]
        hybrid = rng.random() < 0.3
        max_length = rng.randint(0, len(tokens)) if rng.random() < 0.2 else None
        m = store.match(namespace, tokens, max_length=max_length, requires_snapshot=hybrid)
        assert covered(m) == tokens[:m.length]
        assert m.length <= m.matched_tokens
        start = rng.randint(0, m.length) if rng.random() < 0.2 else m.length  # recomputed some
        checkpoints = {d: (rng.choice(["chunk", "message"]), FakeSnapshot(d) if hybrid else None)
                       for d in range(start + 1, len(tokens) + 1) if rng.random() < 0.1}
        segment = FakeSegment(tokens[start:]) if start < len(tokens) else None
        result = store.insert(namespace, tokens, start, segment, checkpoints)
        assert result.reason in (None, "budget")
        if rng.random() < 0.2:
            leases.append(m.lease)  # a request still running
        else:
            store.release(m.lease)
        known.append((namespace, tokens))
        action = rng.random()
        if action < 0.15 and leases:
            store.release(leases.pop(rng.randrange(len(leases))))
        elif action < 0.25:
            ns, seq = rng.choice(known)
            prefix = seq[:rng.randint(1, len(seq))]
            try:
                store.pin(ns, prefix)
                pins.append((ns, prefix))
            except (NotStored, PinBudgetExceeded):
                pass
        elif action < 0.3 and pins:
            store.unpin(*pins.pop(rng.randrange(len(pins))))
        elif action < 0.36:
            store.evict(rng.randint(1, 100) * BPT)
        elif action < 0.38:
            dropped = rng.choice("ab")
            store.drop_namespace(dropped)
            pins = [(ns, seq) for ns, seq in pins if ns != dropped]
        store.check_integrity()
        total = store.stats().total
        assert total.num_bytes <= 300 * BPT and total.num_nodes <= 30
    for lease in leases:
        store.release(lease)
    store.check_integrity()


# ----- the KV budget's share lent to running sequences, and leases that follow a prefill -----

def test_a_reservation_evicts_down_to_the_rest_and_gives_the_room_back(clock):
    store = PrefixStore(max_bytes=1000, max_nodes=100, max_pinned_bytes=500, clock=clock)
    for i in range(5):
        put(store, [i] * 10 + [100 + i])  # 110 bytes each
        clock.now += 1
    assert store.num_bytes == 550
    store.kv_budget.reserve_running(700)
    assert store.kv_budget.store_capacity == 300
    assert store.num_bytes <= 300 and store.free_bytes == 300 - store.num_bytes
    store.kv_budget.reserve_running(0)
    assert store.kv_budget.store_capacity == 1000
    put(store, [9] * 60)
    assert store.num_bytes <= 1000
    store.check_integrity()


def test_a_reservation_keeps_what_is_locked_and_the_capacity_says_so(clock):
    store = PrefixStore(max_bytes=1000, max_nodes=100, max_pinned_bytes=500, clock=clock)
    put(store, list(range(50)))
    lease = store.lease("m", list(range(50)))
    store.kv_budget.reserve_running(900)
    assert store.kv_budget.store_capacity == 500  # the locked 500 bytes cannot go: the capacity says so
    assert store.num_bytes == 500
    store.check_integrity()
    store.release(lease)
    store.kv_budget.reserve_running(900)
    assert store.kv_budget.store_capacity == 100 and store.num_bytes == 0


def test_a_lease_keeps_what_a_prefill_stored_so_far(clock):
    store = PrefixStore(max_bytes=400, max_nodes=100, max_pinned_bytes=100, clock=clock)
    prompt = list(range(30))
    put(store, prompt[:10])  # the first chunk of a prefill
    lease = store.lease("m", prompt[:10])
    clock.now += 1
    put(store, [500 + i for i in range(31)])  # another request needs more room than is free
    assert store.match("m", prompt, max_length=10).length == 10  # the chunk survived
    store.release(store.match("m", prompt, max_length=10).lease)
    store.release(lease)
    store.check_integrity()


def test_without_a_lease_that_chunk_would_have_gone(clock):
    store = PrefixStore(max_bytes=400, max_nodes=100, max_pinned_bytes=100, clock=clock)
    put(store, list(range(10)))
    clock.now += 1
    put(store, [500 + i for i in range(31)])
    assert lookup(store, list(range(30)), max_length=10).length == 0


# ----- what a lease holds, for a sequence that reads its stored prompt in place -----

def test_leased_segments_cover_what_a_prefill_stored(store):
    put(store, A[:10])  # the prompt's first chunk
    put(store, A[:20], start=10)  # its second
    lease = store.lease("m", A[:20])
    lookups_before = store.stats().total
    segments = store.leased_segments(lease, 20)
    assert [t for s in segments for t in s.token_ids] == A[:20]
    assert store.stats().total == lookups_before  # no lookup counted
    assert segments[0] is lookup_segments(store, A[:10])[0]  # the store's own arrays, not copies
    assert [t for s in store.leased_segments(lease, 10) for t in s.token_ids] == A[:10]
    store.release(lease)


def lookup_segments(store, tokens):
    match = store.match("m", tokens, max_length=len(tokens))
    store.release(match.lease)
    return match.segments


def test_leased_segments_refuse_a_length_inside_an_edge_or_past_the_lease(store):
    put(store, A[:20])
    lease = store.lease("m", A[:20])
    assert store.leased_segments(lease, 15) is None  # would take a split (a copy)
    assert store.leased_segments(lease, 25) is None  # more than the lease holds
    assert store.leased_segments(lease, 0) is None
    store.release(lease)
    with pytest.raises(ValueError):
        store.leased_segments(lease, 20)


def test_leased_segments_follow_a_split_of_the_leased_edge(store):
    put(store, A[:20])
    lease = store.lease("m", A[:20])
    put(store, A[:12] + [900, 901])  # splits the edge at 12 while the lease is held
    segments = store.leased_segments(lease, 20)
    assert [s.num_tokens for s in segments] == [12, 8]
    assert [t for s in segments for t in s.token_ids] == A[:20]
    assert [t for s in store.leased_segments(lease, 12) for t in s.token_ids] == A[:12]
    store.release(lease)


# ----- next-token logits where a prompt ended -----


class FakeLogits:
    def __init__(self, name: str, nbytes: int = 7):
        self.name = name
        self.nbytes = nbytes


def test_an_exact_repeat_with_logits_reuses_the_whole_prompt(store):
    put(store, A[:10], checkpoints={10: ("prompt-end", None)})
    before = store.stats().total.num_bytes
    assert store.attach_logits("m", A[:10], FakeLogits("first"))
    assert store.stats().total.num_bytes == before + 7  # charged to the budget
    m = lookup(store, A[:10], whole_with_logits=True)
    assert (m.hit, m.length, m.logits.name, m.reason) == ("exact", 10, "first", None)
    assert covered(m) == A[:10]
    plain = lookup(store, A[:10])  # a caller that cannot use them gets all but the last token, as before
    assert (plain.length, plain.logits) == (9, None)
    assert store.attach_logits("m", A[:10], FakeLogits("second"))  # a node keeps the logits it has
    assert lookup(store, A[:10], whole_with_logits=True).logits.name == "first"


def test_logits_are_used_only_by_a_prompt_ending_exactly_there(store):
    put(store, A[:20])
    assert not store.attach_logits("m", A[:10], FakeLogits("mid-edge"))  # no node ends at 10
    assert not store.attach_logits("m", A[:25], FakeLogits("not stored"))
    assert not store.attach_logits("other", A[:20], FakeLogits("no namespace"))
    assert store.attach_logits("m", A[:20], FakeLogits("end"))
    longer = lookup(store, A[:20] + [900], whole_with_logits=True)  # they are for the token after 20, not 900
    assert (longer.length, longer.logits) == (20, None)
    shorter = lookup(store, A[:19], whole_with_logits=True)
    assert (shorter.length, shorter.logits) == (18, None)


def test_logits_stay_with_their_depth_when_the_edge_splits_and_go_with_the_leaf(clock):
    store = PrefixStore(max_bytes=10**4, max_nodes=100, max_pinned_bytes=100, clock=clock)
    put(store, A[:10])
    store.attach_logits("m", A[:10], FakeLogits("end"))
    put(store, A[:4] + [900])  # splits the edge at 4
    store.check_integrity()
    assert lookup(store, A[:10], whole_with_logits=True).logits.name == "end"
    assert [e.nbytes for e in store.edges("m") if e.depth == 10] == [6 * BPT]  # what export writes: no logits
    store.evict(6 * BPT)  # the leaf holding them
    store.check_integrity()
    assert store.stats().total.num_bytes == 5 * BPT
    assert lookup(store, A[:10], whole_with_logits=True).logits is None


def test_logits_that_do_not_fit_are_not_attached(clock):
    store = PrefixStore(max_bytes=10 * BPT + 3, max_nodes=100, max_pinned_bytes=100, clock=clock)
    put(store, A[:10])
    assert not store.attach_logits("m", A[:10], FakeLogits("big"))  # the node itself is never evicted for them
    assert lookup(store, A[:10]).length == 9
    store.check_integrity()


def test_a_hybrid_exact_repeat_needs_a_snapshot_beside_the_logits(store):
    put(store, A[:10], checkpoints={9: ("prompt-end", FakeSnapshot(9))})
    store.attach_logits("m", A[:10], FakeLogits("end"))
    m = lookup(store, A[:10], whole_with_logits=True, requires_snapshot=True)
    assert (m.length, m.logits) == (9, None)
    put(store, A[:10], checkpoints={10: ("prompt-end", FakeSnapshot(10))})
    m = lookup(store, A[:10], whole_with_logits=True, requires_snapshot=True)
    assert (m.length, m.logits.name, m.snapshot.depth) == (10, "end", 10)
