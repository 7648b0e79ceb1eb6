"""MLX payloads for the prefix store, and forking / capturing live caches.

The store (prefix_store.py) is pure Python and treats what it holds as opaque.
This module gives it real contents:

* ``KVSegment``: the keys and values of every attention layer for a run of
  tokens. Attention caches are trimmable, so any prefix of a stored sequence
  can be rebuilt by concatenating segments.
* ``StateSnapshot``: the state of every non-trimmable layer (the conv/SSM
  state that mlx-lm keeps in ``ArraysCache``) at one exact depth. A hybrid
  model can only resume where such a snapshot exists.

Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

# Spare room given to a forked attention cache, so the first tokens appended
# after a hit write in place instead of triggering a second full copy.
FORK_HEADROOM_TOKENS = 256


@dataclass(frozen=True)
class CacheLayout:
    """Which layers of a model's cache are attention (trimmable) and which are state."""

    attention_layers: tuple[int, ...]
    state_layers: tuple[int, ...]
    other_layers: tuple[int, ...]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_layers)

    @property
    def is_supported(self) -> bool:
        """Only KVCache and ArraysCache layers can be stored and forked exactly."""
        return not self.other_layers

    def describe(self) -> dict[str, int]:
        return {
            "kvcache": len(self.attention_layers),
            "arrays": len(self.state_layers),
            "other": len(self.other_layers),
        }


def make_cache_layout(model: Any) -> CacheLayout:
    """Classify the layers of the cache that mlx-lm makes for ``model``."""
    attention, state, other = [], [], []
    for index, layer_cache in enumerate(make_prompt_cache(model)):
        # Exact type checks: subclasses (rotating, quantized, chunked) do not
        # share KVCache's "any prefix is valid" property.
        if type(layer_cache) is KVCache:
            attention.append(index)
        elif isinstance(layer_cache, ArraysCache):
            state.append(index)
        else:
            other.append(index)
    return CacheLayout(tuple(attention), tuple(state), tuple(other))


class KVSegment:
    """Keys and values of all attention layers for ``num_tokens`` consecutive tokens."""

    __slots__ = ("keys", "values", "num_tokens", "nbytes")

    def __init__(self, keys: list[mx.array], values: list[mx.array], num_tokens: int):
        self.keys = keys
        self.values = values
        self.num_tokens = num_tokens
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in zip(keys, values))

    def split(self, n: int) -> tuple["KVSegment", "KVSegment"]:
        """Copies of the first n tokens and of the rest; self is left untouched.

        Real copies (not views) so that each half owns exactly the memory it
        reports, whatever happens later to the other half.
        """
        assert 0 < n < self.num_tokens, (n, self.num_tokens)
        head = _copy_range(self, 0, n)
        tail = _copy_range(self, n, self.num_tokens)
        return head, tail


class StateSnapshot:
    """The arrays of every non-trimmable layer at one depth of the sequence."""

    __slots__ = ("states", "nbytes")

    def __init__(self, states: list[list[mx.array | None]]):
        self.states = states
        self.nbytes = sum(a.nbytes for layer in states for a in layer if a is not None)


def _copy_range(segment: KVSegment, start: int, end: int) -> KVSegment:
    keys = [mx.contiguous(k[..., start:end, :]) for k in segment.keys]
    values = [mx.contiguous(v[..., start:end, :]) for v in segment.values]
    mx.eval(keys, values)
    return KVSegment(keys, values, end - start)


def capture_segment(cache: list[Any], layout: CacheLayout, start: int, end: int) -> KVSegment | None:
    """Copy positions [start, end) of the live cache's attention layers out for storing."""
    if end <= start:
        return None
    keys = [mx.contiguous(cache[i].keys[..., start:end, :]) for i in layout.attention_layers]
    values = [mx.contiguous(cache[i].values[..., start:end, :]) for i in layout.attention_layers]
    mx.eval(keys, values)
    return KVSegment(keys, values, end - start)


def capture_snapshot(cache: list[Any], layout: CacheLayout) -> StateSnapshot | None:
    """Snapshot the non-trimmable layers at the cache's current depth (None if there are none).

    mlx-lm replaces an ArraysCache's arrays rather than writing into them, so
    holding references would already be safe; new array objects make the
    snapshot immune to an in-place write on the live cache as well.
    """
    if not layout.is_hybrid:
        return None
    states = [[None if a is None else mx.array(a) for a in cache[i].cache] for i in layout.state_layers]
    return StateSnapshot(states)


def fork_cache(
    model: Any,
    layout: CacheLayout,
    segments: list[KVSegment],
    snapshot: StateSnapshot | None,
    length: int,
) -> list[Any]:
    """A fresh live cache holding the first ``length`` tokens of a stored prefix.

    The result never aliases the store: attention layers get new arrays built
    by concatenation, state layers get new array objects. Writing to the fork
    therefore never changes a stored entry (tests pin this).
    """
    cache = make_prompt_cache(model)
    if length == 0:
        return cache
    assert sum(s.num_tokens for s in segments) == length, "segments must cover the prefix exactly"
    assert snapshot is not None or not layout.is_hybrid, "a hybrid fork needs a state snapshot"
    for position, layer_index in enumerate(layout.attention_layers):
        keys = [s.keys[position] for s in segments]
        values = [s.values[position] for s in segments]
        batch, heads, _, key_dim = keys[0].shape
        keys.append(mx.zeros((batch, heads, FORK_HEADROOM_TOKENS, key_dim), keys[0].dtype))
        values.append(mx.zeros((batch, heads, FORK_HEADROOM_TOKENS, values[0].shape[-1]), values[0].dtype))
        layer_cache = cache[layer_index]
        layer_cache.keys = mx.concatenate(keys, axis=2)
        layer_cache.values = mx.concatenate(values, axis=2)
        layer_cache.offset = length
    if snapshot is not None:
        for position, layer_index in enumerate(layout.state_layers):
            cache[layer_index].cache = [None if a is None else mx.array(a) for a in snapshot.states[position]]
    return cache
