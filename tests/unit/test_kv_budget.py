"""The KV budget: the prefix store and the running sequences share --cache-bytes, and never pass it together."""

from __future__ import annotations

import random

import pytest

from prefixd.daemon.cache import KvBudget, PrefixStore

BYTES_PER_TOKEN = 10


class Tokens:
    """A fake segment: the KV of its tokens, BYTES_PER_TOKEN each."""

    def __init__(self, token_ids):
        self.token_ids = list(token_ids)
        self.num_tokens = len(self.token_ids)
        self.nbytes = BYTES_PER_TOKEN * self.num_tokens

    def split(self, n: int):
        return Tokens(self.token_ids[:n]), Tokens(self.token_ids[n:])


def store_with(total_bytes: int) -> tuple[KvBudget, PrefixStore]:
    budget = KvBudget(total_bytes)
    return budget, PrefixStore(budget, max_nodes=10_000, max_pinned_bytes=total_bytes // 4)


def put(store: PrefixStore, tokens) -> None:
    store.insert("m", list(tokens), 0, Tokens(tokens))


def test_running_sequences_take_their_room_from_the_store_and_give_it_back():
    budget, store = store_with(1000)
    for i in range(8):
        put(store, [i] * 10 + [100 + i])  # 110 bytes each
    assert store.num_bytes == 880 and budget.stored_bytes == 880
    assert budget.fits_running(1000) and not budget.fits_running(1001)
    budget.reserve_running(600)
    assert budget.store_capacity == 400 and store.num_bytes <= 400
    put(store, list(range(200, 260)))  # 600 bytes: more than the store may hold now
    assert store.num_bytes <= 400
    budget.reserve_running(0)
    assert budget.store_capacity == 1000
    put(store, list(range(300, 360)))
    assert store.num_bytes > 400  # the room came back
    store.check_integrity()


def test_a_side_run_gets_free_room_or_a_small_share_only():
    budget, store = store_with(1600)
    put(store, range(120))  # 1200 bytes stored
    budget.reserve_running(200)
    assert budget.reserve_side(200)  # free already: 200 + 1200 + 200 <= 1600
    assert budget.reserve_side(0) and budget.side_bytes == 0
    assert not budget.reserve_side(300)  # not free, and more than a sixteenth (100) of the budget
    assert store.num_bytes == 1200  # a refused side run evicted nothing
    assert budget.reserve_side(100)  # a sixteenth: it may cost the store that much
    assert store.num_bytes + budget.reserved_bytes <= 1600
    assert not budget.reserve_side(1500)  # beside the running ones it cannot fit at all
    assert not budget.fits_running(1600 - 99)  # the side run's room counts at admission


def test_stored_and_reserved_bytes_stay_within_the_budget_at_every_step():
    total = 4000
    budget, store = store_with(total)
    rng = random.Random(7)
    running: list[int] = []
    for step in range(400):
        action = rng.random()
        if action < 0.5:
            start = rng.randrange(50)
            put(store, [start + i for i in range(rng.randrange(1, 40))])
        elif action < 0.75:
            wanted = rng.randrange(50, 1500)
            if budget.fits_running(sum(running) + wanted):
                running.append(wanted)
                budget.reserve_running(sum(running))
        elif action < 0.9 and running:
            running.pop(rng.randrange(len(running)))
            budget.reserve_running(sum(running))
        else:
            budget.reserve_side(rng.choice([0, 100, 250]))
        assert store.num_bytes + budget.reserved_bytes <= total, f"step {step}"
        assert store.num_bytes <= budget.store_capacity
    store.check_integrity()


def test_the_store_reports_what_running_sequences_leave_it():
    budget, store = store_with(1000)
    budget.reserve_running(250)
    assert store.stats().total.max_bytes == 750  # /metrics' prefixd_store_max_bytes and `prefixd stats`


def test_a_budget_without_a_store_still_decides_admission():
    budget = KvBudget(500)
    assert budget.fits_running(500)
    budget.reserve_running(400)
    assert budget.store_capacity == 100 and budget.stored_bytes == 0
    assert not budget.reserve_side(200)


def test_one_store_per_budget_and_no_negative_figures():
    budget, _ = store_with(1000)
    with pytest.raises(ValueError, match="already has its store"):
        PrefixStore(budget, max_nodes=10, max_pinned_bytes=0)
    with pytest.raises(ValueError, match="cannot be negative"):
        KvBudget(-1)
    with pytest.raises(ValueError, match="cannot be negative"):
        budget.reserve_running(-5)
