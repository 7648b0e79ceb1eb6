"""``--kv-bits`` live caches keep their packed form in step with what attention reads, through every move of a batch.

A capture stores a round-trip cache's packed parts (kv/round_trip_cache.py,
fork.capture_segment) and a warm hit attends to their dequantization, so a
part that falls out of step with the live cache (a filter, extend, roll or
trim applied to one and not the other) would store another position's KV,
or another row's. The model tests that would notice need MLX's own BLAS
(tests/model/test_quantized_kv_exactness.py), so this drives both kinds
(global and window) through a row's whole life without a model, on random
keys and values: solo passes, merge into mlx-lm's batch, decode steps,
prompt tails joining with right padding (prepare, finalize), extend,
filter, extract, trim, and a multi-token pass after the window rotated.
After every step, dequantizing each packed buffer gives exactly the live
buffer, and the parts' bookkeeping (offsets, padding, rotation, a window's
record of its decode steps) is the live cache's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import mlx.core as mx

from prefixd.daemon.kv.quantized_kv import KvQuantization
from prefixd.daemon.kv.round_trip_cache import RoundTripKVCache, RoundTripWindowKVCache

WINDOW = 16
HEADS, HEAD_DIM = 2, 64
# Every field of mlx-lm's (batch) caches and prefixd's window records that says where a position sits.
BOOKKEEPING = ("offset", "_idx", "_offset", "left_padding", "rotated", "_right_padding", "_lengths", "kept_from")


def make_row(kind: str, quant: KvQuantization) -> Any:
    return RoundTripKVCache(quant) if kind == "global" else RoundTripWindowKVCache(WINDOW, quant)


def same(a: Any, b: Any) -> bool:
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return isinstance(a, mx.array) and isinstance(b, mx.array) and a.shape == b.shape and mx.array_equal(a, b).item()
    return a == b


def assert_in_step(cache: Any, when: str) -> None:
    """The packed parts dequantize to exactly the live keys and values, kept the same way."""
    quant, parts = cache.quant, cache.packed
    for field in BOOKKEEPING:
        if hasattr(cache, field):
            assert all(same(getattr(part, field), getattr(cache, field)) for part in parts), (when, field)
    for role in ("keys", "values"):
        live = getattr(cache, role)
        packed = tuple(getattr(part, role) for part in parts)
        assert all(p.shape[:3] == live.shape[:3] for p in packed), (when, role, live.shape, [p.shape for p in packed])
        assert same(quant.dequantize(packed), live), (when, role)
    for live, packed in zip(records(cache), zip(*(records(part) for part in parts))):
        assert all(same(part_from, live[0]) for part_from, _ in packed), (when, "record start")
        assert all(len(part_kept) == len(live[1]) for _, part_kept in packed), (when, "record length")
        for position, (keys, values) in enumerate(live[1]):
            assert same(quant.dequantize(tuple(kept[position][0] for _, kept in packed)), keys), (when, position)
            assert same(quant.dequantize(tuple(kept[position][1] for _, kept in packed)), values), (when, position)


def records(cache: Any) -> list[tuple[int, list[tuple[mx.array, mx.array]]]]:
    """A window cache's records of its decode steps, (kept_from, kept) per row; none for a global layer."""
    if hasattr(cache, "rows"):  # BatchWindowKVCache
        return [row if row is not None else (-1, []) for row in cache.rows]
    if hasattr(cache, "kept"):  # WindowKVCache
        return [(cache.kept_from, cache.kept)]
    return []


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["global", "window"])
def test_the_packed_kv_follows_every_row_through_the_batch(kind, bits):
    quant = KvQuantization(bits)
    rng = np.random.default_rng(bits)

    def feed(cache: Any, num_rows: int, num_tokens: int, when: str) -> None:
        keys, values = (rng.standard_normal((num_rows, HEADS, num_tokens, HEAD_DIM)).astype(np.float32) for _ in "kv")
        cache.update_and_fetch(mx.array(keys), mx.array(values))
        mx.eval(cache.keys, cache.values, [part.state for part in cache.packed])
        assert_in_step(cache, when)

    rows = []
    for length in (5, 2 * WINDOW - 4, 9, 3):  # shorter than the window, longer (the window rotates), between
        row = make_row(kind, quant)
        feed(row, 1, length, f"row of {length}: prefill")
        for step in range(3):
            feed(row, 1, 1, f"row of {length}: step {step}")
        rows.append(row)

    batch = type(rows[0]).merge(rows[:2])
    assert_in_step(batch, "merged")
    for step in range(20):
        feed(batch, 2, 1, f"batch step {step}")

    joining = type(rows[0]).merge(rows[2:])  # two prompt tails of 4 and 2 tokens, fed as one right-padded pass
    joining.prepare(lengths=[4, 2], right_padding=[0, 2])
    assert_in_step(joining, "prepared")
    feed(joining, 2, 4, "prompt tails")
    joining.finalize()
    assert_in_step(joining, "finalized")

    batch.extend(joining)
    assert_in_step(batch, "extended")
    for step in range(5):
        feed(batch, 4, 1, f"extended step {step}")

    batch.filter([0, 2, 3])
    assert_in_step(batch, "filtered")
    for step in range(WINDOW + 3):
        feed(batch, 3, 1, f"filtered step {step}")

    row = batch.extract(1)
    assert isinstance(row, type(rows[0]))
    assert_in_step(row, "extracted")
    for step in range(3):
        feed(row, 1, 1, f"extracted step {step}")
    row.trim(1)
    assert_in_step(row, "trimmed")
    feed(row, 1, 1, "step after trim")
    feed(row, 1, 6, "multi-token pass")  # on a window rotated by the steps before: put back in order first
    for step in range(WINDOW + 2):
        feed(row, 1, 1, f"step after the multi-token pass {step}")
    assert row.offset == 9 + 3 + 4 + 5 + (WINDOW + 3) + 3 - 1 + 1 + 6 + (WINDOW + 2)  # rows[2]'s whole life
    if kind == "window":
        assert 0 < row._idx < WINDOW == row.keys.shape[2]  # rotated again: the oldest position is not in slot 0
