"""Sliding-window layers (mlx-lm's ``RotatingKVCache``, ``keep == 0``): read positions out, rebuild a window.

A live rotating cache holds only recent positions, in one of three shapes:
* in order: after a multi-token pass (the last ``window - 1`` positions before
  the pass plus the whole pass, so more than ``window`` for a moment), or full
  with its last write at the end; ``_idx == len``;
* rotated: full (``window`` slots) after single-token steps, the oldest
  position at slot ``_idx``; ``_idx < offset``;
* growing: fewer than ``window`` positions so far, slots ``[0, offset)`` used
  and spare slots after them; ``_idx == offset``.

The store keeps every position's KV (window_range reads them out after each
pass), so resuming at depth d needs only the last ``min(d, window)`` of them:
window_cache puts them back *in order*, the shape a multi-token pass leaves.
From there mlx-lm's next step does what it does after any prefill pass: a
multi-token pass keeps the last ``window - 1`` positions and appends, a single
token trims to ``window`` and rotates. A cold run reaches the same arrays, so
a fork is exact, at any depth.

Decode steps rotate the window: an answer longer than the window would drop
positions before they are stored (answers are stored when they end). The
caches prefixd makes (``WindowKVCache``) therefore also keep the KV of their
single-token steps since the last multi-token pass, so the whole answer can
be stored. In mlx-lm's batch they merge into a ``BatchWindowKVCache``, which
keeps one such record per row and hands it back when a row is extracted; a
row whose record broke (a multi-token pass in the batch: prompt tails handed
to it) or that was merged from a plain cache stores only what its window
still holds. The record costs what storing the answer costs (the engine
reserves every token's KV for a sequence already), and never changes what
the cache computes.
Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache


def held_range(layer_cache: Any) -> tuple[int, int]:
    """The absolute positions [first, end) whose KV the live window layer holds now."""
    if layer_cache.keys is None:
        return 0, 0
    size, idx, offset = layer_cache.keys.shape[2], layer_cache._idx, layer_cache.offset
    if idx == size or idx < offset:  # in order, or rotated: every slot holds a position
        return offset - size, offset
    return 0, offset  # growing: slots [0, offset)


def window_range(layer_cache: Any, start: int, end: int) -> tuple[mx.array, mx.array] | None:
    """Keys and values of positions [start, end) from a live window layer; None if it no longer holds them all."""
    first, last = held_range(layer_cache)
    if not first <= start <= end <= last:
        return _kept_range(layer_cache, start, end)
    keys, values = layer_cache.keys, layer_cache.values
    size, idx = keys.shape[2], layer_cache._idx
    if idx == size or idx == last:  # slot = position - first
        return keys[..., start - first : end - first, :], values[..., start - first : end - first, :]
    # Rotated: position p sits at slot (idx + p - first) % size.
    begin = (idx + start - first) % size
    stop = begin + (end - start)
    if stop <= size:
        return keys[..., begin:stop, :], values[..., begin:stop, :]
    wrap = stop - size
    return (
        mx.concatenate([keys[..., begin:, :], keys[..., :wrap, :]], axis=2),
        mx.concatenate([values[..., begin:, :], values[..., :wrap, :]], axis=2),
    )


def _kept_range(layer_cache: Any, start: int, end: int) -> tuple[mx.array, mx.array] | None:
    """Positions [start, end) from a WindowKVCache's record of its recent steps, if it holds them all."""
    kept = getattr(layer_cache, "kept", None)
    if not kept or not layer_cache.kept_from <= start <= end <= layer_cache.offset:
        return None
    keys = [k for k, _ in kept]
    values = [v for _, v in kept]
    if end == start:
        return keys[0][..., :0, :], values[0][..., :0, :]
    lo, hi = start - layer_cache.kept_from, end - layer_cache.kept_from
    return mx.concatenate(keys[lo:hi], axis=2), mx.concatenate(values[lo:hi], axis=2)


class WindowKVCache(RotatingKVCache):
    """mlx-lm's RotatingKVCache (``keep == 0``) that also keeps what its window drops during decode.

    ``kept`` holds one (keys, values) per position from ``kept_from`` to
    ``offset``: the last position of the latest multi-token pass (a prefill
    that also fed the prompt's last token stores up to the one before it),
    then every single-token step. A multi-token pass starts it over: prefill
    passes are stored as soon as they end, from the window itself. The arrays
    and masks are RotatingKVCache's; merge makes a BatchWindowKVCache, which
    carries the records through the batch.
    """

    def __init__(self, max_size: int):
        super().__init__(max_size=max_size)
        self.kept: list[tuple[mx.array, mx.array]] = []
        self.kept_from = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            if not self.kept:
                self.kept_from = self.offset
            self.kept.append((keys, values))
        else:
            self.kept = [(keys[..., -1:, :], values[..., -1:, :])]
            self.kept_from = self.offset + keys.shape[2] - 1
        return super().update_and_fetch(keys, values)

    def trim(self, n: int) -> int:
        n = super().trim(n)
        del self.kept[max(0, self.offset - self.kept_from) :]
        return n

    @classmethod
    def merge(cls, caches: list[Any]) -> "BatchWindowKVCache":
        batch = BatchRotatingKVCache.merge(caches)
        batch.__class__ = BatchWindowKVCache
        batch.rows = [_record_of(c) for c in caches]
        return batch


def _record_of(cache: Any) -> tuple[int, list[tuple[mx.array, mx.array]]] | None:
    """A row's record for the batch: (kept_from, kept), or None where there is none to carry on."""
    if not isinstance(cache, WindowKVCache):
        return None
    if not cache.kept:
        return (cache.offset, [])  # its next single-token step starts one
    return (cache.kept_from, list(cache.kept))


class BatchWindowKVCache(BatchRotatingKVCache):
    """mlx-lm's BatchRotatingKVCache keeping each row's WindowKVCache record through single-token steps.

    Made by WindowKVCache.merge only. ``rows[r]`` is row r's (kept_from,
    kept) or None (no record: a plain row, or a multi-token pass broke it).
    extract checks a record against the row's offset before handing it back.
    """

    rows: list[tuple[int, list[tuple[mx.array, mx.array]]] | None]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] == 1:
            for r, record in enumerate(self.rows):
                if record is not None:
                    record[1].append((keys[r : r + 1], values[r : r + 1]))
        else:  # prompt tails with padding: positions per row are not worth tracking here
            self.rows = [None] * len(self.rows)
        return super().update_and_fetch(keys, values)

    def filter(self, batch_indices: Any) -> None:
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        super().filter(batch_indices)
        self.rows = [self.rows[int(i)] for i in indices]

    def extend(self, other: Any) -> None:
        others = other.rows if isinstance(other, BatchWindowKVCache) else [None] * other.offset.shape[0]
        rows = self.rows + others
        super().extend(other)
        self.rows = rows

    def extract(self, idx: int) -> WindowKVCache:
        plain = super().extract(idx)
        cache = WindowKVCache(self.max_size)
        cache.keys, cache.values, cache.offset, cache._idx = plain.keys, plain.values, plain.offset, plain._idx
        record = self.rows[idx]
        if record is not None and record[1] and record[0] + len(record[1]) == cache.offset:
            cache.kept_from, cache.kept = record[0], list(record[1])
        return cache


def window_cache(
    window_size: int, keys: mx.array | None = None, values: mx.array | None = None, depth: int = 0
) -> WindowKVCache:
    """A window layer at ``depth`` holding ``keys``/``values``: the last min(depth, window_size) positions, in order."""
    cache = WindowKVCache(window_size)
    if depth:
        fill_window(cache, keys, values, depth)
    return cache


def fill_window(cache: WindowKVCache, keys: mx.array, values: mx.array, depth: int) -> None:
    """Make a fresh window layer hold ``keys``/``values`` at ``depth`` (see window_cache)."""
    assert cache.offset == 0 and keys.shape[2] == min(depth, cache.max_size), (keys.shape, depth, cache.max_size)
    cache.keys, cache.values = keys, values
    cache.offset, cache._idx = depth, keys.shape[2]
