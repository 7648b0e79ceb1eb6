"""The MLX payloads the prefix store holds, opaque to it (cache/ never imports mlx).

* ``KVSegment``: the keys and values of every attention layer for a run of
  tokens. Attention caches are trimmable, so any prefix of a stored sequence
  can be rebuilt by concatenating segments. A ``--kv-bits`` model's segments
  hold each layer's keys and values packed (quantized_kv.py: codes, scales,
  biases), and count what they hold.
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

from .quantized_kv import Packed


class KVSegment:
    """Keys and values of all attention layers for ``num_tokens`` consecutive tokens.

    ``bits`` 0: one array per layer; 8 or 4: one ``Packed`` per layer, whose
    groups run along head_dim, so a token range of it is that range packed.
    """

    __slots__ = ("keys", "values", "num_tokens", "nbytes", "bits")
    source = "memory"  # where it was computed; persist.entries.DiskKVSegment says "disk"

    def __init__(
        self, keys: list[mx.array] | list[Packed], values: list[mx.array] | list[Packed], num_tokens: int, bits: int = 0
    ):
        self.keys = keys
        self.values = values
        self.num_tokens = num_tokens
        self.bits = bits
        self.nbytes = sum(array.nbytes for layer in keys + values for array in _arrays(layer))

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


def _arrays(layer: mx.array | Packed) -> tuple[mx.array, ...]:
    return layer if isinstance(layer, tuple) else (layer,)


def _copy_layer(layer: mx.array | Packed, start: int, end: int) -> mx.array | Packed:
    if isinstance(layer, tuple):
        return tuple(mx.contiguous(array[..., start:end, :]) for array in layer)
    return mx.contiguous(layer[..., start:end, :])


def _copy_range(segment: KVSegment, start: int, end: int) -> KVSegment:
    keys = [_copy_layer(k, start, end) for k in segment.keys]
    values = [_copy_layer(v, start, end) for v in segment.values]
    mx.eval(keys, values)
    return KVSegment(keys, values, end - start, segment.bits)


def segments_source(segments: Iterable[KVSegment]) -> str:
    """``disk`` when any reused segment was read from the disk cache, else ``memory``."""
    return "disk" if any(segment.source == "disk" for segment in segments) else "memory"
