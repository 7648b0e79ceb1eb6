"""Live mlx-lm caches to and from store payloads: capture what a prefill computed, fork a hit.

A fork never aliases the store, and a capture never aliases the live cache,
so writing to either never changes the other (tests pin this).
Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .layout import CacheLayout
from .segments import KVSegment, StateSnapshot

# Spare room given to a forked attention cache, so the first tokens appended
# after a hit write in place instead of triggering a second full copy.
FORK_HEADROOM_TOKENS = 256


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
    # Evaluated now: an unevaluated copy keeps its input alive, and the input
    # of a row's state is a view of the whole decode batch's array.
    mx.eval([a for layer in states for a in layer if a is not None])
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
