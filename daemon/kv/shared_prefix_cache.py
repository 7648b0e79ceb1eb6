"""A hit's live cache that reads the stored segments in place: a fork without a copy.

Today's fork (fork.py) copies every stored segment of a hit into one fresh
buffer per layer. On this project's CPU that copy costs more than three
decode steps' attention (SmolLM2, 4,096 tokens: 114 ms against 37 ms a step;
bench/probes/shared_prefix_probe.py), and it is most of an exact hit's time
to first token. Here a global attention layer keeps references to the
store's arrays (``prefix_keys``/``prefix_values``, one piece per segment, never
written) and appends new tokens into a buffer of its own, as mlx-lm's
KVCache would (``keys``/``values`` hold only those). Attention reads both
through models/prefix_attention.py, which tail_attention.routed_attention
calls when it sees this class.

The store never changes an array it holds (segments are replaced, not
written), and a running sequence holds a lease on what it reused, so the
store cannot evict its pieces: they are counted once, in the store, and the
scheduler reserves only the sequence's own positions and the pieces that
are copies (short segments joined here, a stored segment's head cut for a
hit inside it). Not counted: a stored segment that another insert splits
while a sequence reads it stays alive beside the store's two copies of it
for as long as that sequence runs (at most one segment per split edge).

In mlx-lm's decode batch the rows stay so (SharedPrefixBatchKVCache): its
padded buffer holds only their own positions, and rows on the same pieces
read them in one broadcast matmul.
Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

# Room made in a materialized cache for the tokens that follow (fork.py gives a fork as much).
MATERIALIZE_HEADROOM_TOKENS = 256


class SharedPrefixKVCache(KVCache):
    """A global attention layer: stored pieces read in place, then the sequence's own tokens."""

    def __init__(self, prefix_keys: list[mx.array], prefix_values: list[mx.array], in_store: int | None = None):
        """``in_store``: how many of the pieces' tokens are the store's own arrays (default all), the
        rest being copies made for this sequence (short segments joined): what it need not reserve."""
        super().__init__()
        self.prefix_keys = list(prefix_keys)  # the store's arrays (or this fork's joined copies): never written
        self.prefix_values = list(prefix_values)
        self.prefix_len = sum(k.shape[2] for k in self.prefix_keys)
        self.in_store = self.prefix_len if in_store is None else in_store
        self.offset = self.prefix_len  # keys/values (mlx-lm's names) hold positions prefix_len.. of the sequence

    @property
    def own_len(self) -> int:
        return self.offset - self.prefix_len

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append to the own buffer; returns the own positions only (prefix_attention adds the pieces)."""
        held = self.own_len
        if self.keys is None or held + keys.shape[2] > self.keys.shape[2]:
            steps = (self.step + keys.shape[2] - 1) // self.step
            grown_keys = mx.zeros((*keys.shape[:2], steps * self.step, keys.shape[3]), keys.dtype)
            grown_values = mx.zeros((*values.shape[:2], steps * self.step, values.shape[3]), values.dtype)
            if self.keys is None:
                self.keys, self.values = grown_keys, grown_values
            else:
                self.keys = mx.concatenate([self.keys[..., :held, :], grown_keys], axis=2)
                self.values = mx.concatenate([self.values[..., :held, :], grown_values], axis=2)
        self.offset += keys.shape[2]
        self.keys[..., held : held + keys.shape[2], :] = keys
        self.values[..., held : held + keys.shape[2], :] = values
        return self.keys[..., : self.own_len, :], self.values[..., : self.own_len, :]

    def positions(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Keys and values of sequence positions [start, end): views where one piece holds them."""
        keys, values, piece_start = [], [], 0
        pieces = [(k, v, k.shape[2]) for k, v in zip(self.prefix_keys, self.prefix_values)]
        if self.own_len:
            pieces.append((self.keys, self.values, self.own_len))
        for piece_keys, piece_values, length in pieces:
            lo, hi = max(start, piece_start), min(end, piece_start + length)
            if lo < hi:
                keys.append(piece_keys[..., lo - piece_start : hi - piece_start, :])
                values.append(piece_values[..., lo - piece_start : hi - piece_start, :])
            piece_start += length
        if piece_start < end or not keys:
            raise ValueError(f"positions [{start}, {end}) are not all in a cache of {self.offset}")
        if len(keys) == 1:
            return keys[0], values[0]
        return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)

    @property
    def state(self):
        """What evaluating this cache means: the pieces (evaluated already) and the own positions."""
        own = [] if self.keys is None else [self.keys[..., : self.own_len, :], self.values[..., : self.own_len, :]]
        return [*self.prefix_keys, *self.prefix_values, *own]

    @state.setter
    def state(self, value):
        raise TypeError("a shared-prefix cache is made by a fork, not from a saved state")

    def trim(self, n: int) -> int:
        """Drop the last n positions; cutting into the pieces keeps views of them (still no copy)."""
        n = min(self.offset, n)
        from_own = min(n, self.own_len)
        self.offset -= from_own
        cut = n - from_own
        if cut:
            keep = self.prefix_len - cut
            self.prefix_keys, self.prefix_values = _first_positions(self.prefix_keys, self.prefix_values, keep)
            self.prefix_len = self.offset = keep
            self.in_store = min(self.in_store, keep)
            self.keys = self.values = None
        return n

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        """The sequence's own bytes: the pieces are the store's (and counted there)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @classmethod
    def adopt(cls, plain: KVCache) -> "SharedPrefixKVCache":
        """A plain cache as a shared one without pieces (no copy), so that it can join a batch of shared rows."""
        cache = cls([], [])
        cache.keys, cache.values, cache.offset = plain.keys, plain.values, plain.offset
        return cache

    def own_view(self) -> KVCache:
        """A plain cache over the own positions only (a view), for mlx-lm's merge."""
        own = KVCache()
        if self.own_len:
            own.keys, own.values, own.offset = self.keys, self.values, self.own_len
        return own

    @classmethod
    def merge(cls, caches: list[Any]) -> "SharedPrefixBatchKVCache":
        return SharedPrefixBatchKVCache.of(caches)


class SharedPrefixBatchKVCache(BatchKVCache):
    """mlx-lm's decode batch of shared-prefix rows: each row's pieces read in place, the own positions padded.

    What mlx-lm's BatchKVCache holds here is the rows' own positions (a
    chat turn's tail and the answer, left-padded as mlx-lm pads); ``offset``
    stays each row's absolute position (pieces included), which rotary
    embeddings read. Rows that share the same pieces (one system prompt)
    attend to them in one broadcast matmul (models/prefix_attention.py).
    """

    row_keys: list[list[mx.array]]
    row_values: list[list[mx.array]]

    @classmethod
    def of(cls, caches: list[SharedPrefixKVCache]) -> "SharedPrefixBatchKVCache":
        if not all(isinstance(cache, SharedPrefixKVCache) for cache in caches):
            raise TypeError("a batch of shared-prefix rows takes shared-prefix caches only (SharedPrefixKVCache.adopt)")
        batch = BatchKVCache.merge([cache.own_view() for cache in caches])
        batch.__class__ = cls
        batch.row_keys = [cache.prefix_keys for cache in caches]
        batch.row_values = [cache.prefix_values for cache in caches]
        batch.offset = batch.offset + mx.array([cache.prefix_len for cache in caches])
        return batch

    @property
    def has_pieces(self) -> bool:
        return any(self.row_keys)

    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)
        indices = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.row_keys = [self.row_keys[i] for i in indices]
        self.row_values = [self.row_values[i] for i in indices]

    def extend(self, other: "SharedPrefixBatchKVCache") -> None:
        super().extend(other)
        self.row_keys = self.row_keys + other.row_keys
        self.row_values = self.row_values + other.row_values

    def extract(self, idx: int) -> SharedPrefixKVCache:
        own = super().extract(idx)
        cache = SharedPrefixKVCache(self.row_keys[idx], self.row_values[idx])
        if own.offset:
            cache.keys, cache.values = own.keys, own.values
            cache.offset += own.offset
        return cache

    def __deepcopy__(self, memo: dict) -> "SharedPrefixBatchKVCache":
        """mlx-lm copies a batch when it splits one: the pieces are the store's and stay shared."""
        copied = SharedPrefixBatchKVCache.__new__(SharedPrefixBatchKVCache)
        copied.__dict__.update(self.__dict__)
        for name in ("keys", "values", "offset", "left_padding", "_right_padding"):
            value = getattr(self, name, None)
            setattr(copied, name, None if value is None else mx.array(value))
        copied.row_keys, copied.row_values = list(self.row_keys), list(self.row_values)
        return copied


def _first_positions(keys: list[mx.array], values: list[mx.array], keep: int) -> tuple[list[mx.array], list[mx.array]]:
    kept_keys, kept_values, held = [], [], 0
    for piece_keys, piece_values in zip(keys, values):
        if held >= keep:
            break
        take = min(piece_keys.shape[2], keep - held)
        kept_keys.append(piece_keys if take == piece_keys.shape[2] else piece_keys[..., :take, :])
        kept_values.append(piece_values if take == piece_values.shape[2] else piece_values[..., :take, :])
        held += take
    return kept_keys, kept_values


def materialized(cache: Any) -> Any:
    """A plain KVCache holding what a shared-prefix cache holds (a copy); any other cache as it is."""
    if not isinstance(cache, SharedPrefixKVCache) or cache.offset == 0:
        return cache if not isinstance(cache, SharedPrefixKVCache) else KVCache()
    keys, values = cache.positions(0, cache.offset)
    headroom = (*keys.shape[:2], MATERIALIZE_HEADROOM_TOKENS)
    plain = KVCache()
    plain.keys = mx.concatenate([keys, mx.zeros((*headroom, keys.shape[3]), keys.dtype)], axis=2)
    plain.values = mx.concatenate([values, mx.zeros((*headroom, values.shape[3]), values.dtype)], axis=2)
    plain.offset = cache.offset
    return plain


def tokens_read_in_store(cache: list[Any]) -> int:
    """How many of a sequence's positions it reads from the store's own arrays (0: it copied)."""
    return next((layer.in_store for layer in cache if isinstance(layer, SharedPrefixKVCache)), 0)


def batch_rows(cache: list[Any], shares_forks: bool) -> list[Any]:
    """A sequence's cache as mlx-lm's batch will merge it.

    mlx-lm merges a layer by the first row's class, so in a model that
    shares forks every global layer joins as a shared-prefix cache (a cold
    row's plain cache adopted, without a copy); anywhere else a shared layer
    (none is made there) would be copied plain.
    """
    if shares_forks:
        return [SharedPrefixKVCache.adopt(layer) if type(layer) is KVCache else layer for layer in cache]
    if any(isinstance(layer, SharedPrefixKVCache) for layer in cache):
        return [materialized(layer) for layer in cache]
    return cache
