"""The MLX payloads the prefix store holds, opaque to it (cache/ never imports mlx).

* ``KVSegment``: the keys and values of every attention layer for a run of
  tokens. Attention caches are trimmable, so any prefix of a stored sequence
  can be rebuilt by concatenating segments.
* ``StateSnapshot``: the state of every non-trimmable layer (the conv/SSM
  state that mlx-lm keeps in ``ArraysCache``) at one exact depth. A hybrid
  model can only resume where such a snapshot exists.

A segment says where it was computed (``source``: ``memory``, or ``disk`` for
what persist/ read back), so a reply can tell the user.

Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from typing import Iterable

import mlx.core as mx


class KVSegment:
    """Keys and values of all attention layers for ``num_tokens`` consecutive tokens."""

    __slots__ = ("keys", "values", "num_tokens", "nbytes")
    source = "memory"  # where it was computed; persist.entries.DiskKVSegment says "disk"

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


def segments_source(segments: Iterable[KVSegment]) -> str:
    """``disk`` when any reused segment was read from the disk cache, else ``memory``."""
    return "disk" if any(segment.source == "disk" for segment in segments) else "memory"
