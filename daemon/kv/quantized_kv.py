"""``--kv-bits``: how a model's attention KV is quantized, the same way in the store and in every live pass.

MLX's affine quantization (``mx.quantize``) works in groups along the last
axis (head_dim), so it acts on each token of each head on its own: a token
range of a packed array is the packed form of that token range, and how a
prompt is cut into segments or prefill passes changes nothing.

Quantizing is not idempotent: quantizing a dequantized array again moves
about a fifth of its rows by a whole step (MLX picks each group's scale so
that zero is exact, and a dequantized group has a slightly different range).
So the store keeps the packed form computed from the model's own keys and
values, never a re-quantization of what a live cache holds: the live caches
(round_trip_cache.py) keep that packed form beside the dequantized values
attention reads, and a capture takes it from there.

Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

KV_BITS = (8, 4)  # what --kv-bits accepts; 0 anywhere else means full precision
GROUP_SIZES = (64, 32)  # preferred first: a larger group stores fewer scales and biases

Packed = tuple[mx.array, mx.array, mx.array]  # codes (uint32), scales, biases: mx.quantize's output


class UnquantizableKV(ValueError):
    """A head dimension that no supported quantization group divides."""


def group_size_for(dim: int) -> int:
    """The quantization group of an array whose last axis (head_dim) is ``dim``."""
    for size in GROUP_SIZES:
        if dim % size == 0:
            return size
    raise UnquantizableKV(f"head dimension {dim} is not a multiple of {GROUP_SIZES[-1]}: --kv-bits cannot group it")


@dataclass(frozen=True)
class KvQuantization:
    """One model's KV quantization: ``bits`` per value, groups chosen by each array's head dimension."""

    bits: int

    def __post_init__(self) -> None:
        assert self.bits in KV_BITS, self.bits

    def quantize(self, x: mx.array) -> Packed:
        return tuple(mx.quantize(x, group_size=group_size_for(x.shape[-1]), bits=self.bits))

    def dequantize(self, packed: Packed) -> mx.array:
        codes, scales, _ = packed
        dim = codes.shape[-1] * 32 // self.bits
        return mx.dequantize(*packed, group_size=dim // scales.shape[-1], bits=self.bits)


def describe_kv(bits: int, dtype: str, head_dims: tuple[int, ...] = ()) -> str:
    """What stats and replies say of a model's KV: ``float32``, or ``q8 (group 64)`` (``q8`` before the model loads)."""
    if not bits:
        return dtype
    groups = sorted({group_size_for(dim) for dim in head_dims}, reverse=True)
    return f"q{bits} (group {'/'.join(map(str, groups))})" if groups else f"q{bits}"
