"""Live caches of a ``--kv-bits`` model: attention reads quantized-then-dequantized KV, and the packed form is kept.

Every key and value a pass appends is quantized (quantized_kv.py) and what
attention reads is its dequantization, in every pass: cold or warm prefill,
the shadow run, solo decode steps and mlx-lm's batch. So a warm hit, which
forks the dequantized stored segments, computes what a cold run computes.

The packed form of every position is kept beside it, in three caches of the
same kind as the live one (``packed``: codes, scales, biases; each holds
keys and values), that grow, rotate, trim, merge into mlx-lm's batch,
filter, extend and extract exactly as the live cache does: the same mlx-lm
code moves them, so they stay aligned position for position. A capture
reads them (fork.capture_segment): the store keeps the quantization of the
model's own KV, which a re-quantization of the dequantized values is not.
They cost a share of the live KV (float32, 8 bits: 28%) and are counted in
the model's KV per token (loaded_model._measure_cache_bytes).

mlx-lm's own ``QuantizedKVCache`` has no ``merge``: its BatchGenerator
cannot batch it (docs/decisions.md).
Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .quantized_kv import KvQuantization
from .window_kv import BatchWindowKVCache, WindowKVCache

NUM_PACKED_PARTS = 3  # codes, scales, biases


class _RoundTrip:
    """What the four round-trip caches share; mixed in before the mlx-lm (or window_kv) class it extends."""

    quant: KvQuantization
    packed: list[Any]  # NUM_PACKED_PARTS caches of the live cache's kind

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        packed_keys, packed_values = self.quant.quantize(keys), self.quant.quantize(values)
        held = [part.update_and_fetch(k, v) for part, k, v in zip(self.packed, packed_keys, packed_values)]
        # Attention evaluates only what this returns: tied to the packed parts' writes, they run in the
        # same evaluation instead of piling up as a lazy graph until the answer is captured.
        keys, values = mx.depends(
            [self.quant.dequantize(packed_keys), self.quant.dequantize(packed_values)],
            [array for pair in held for array in pair],
        )
        return super().update_and_fetch(keys, values)

    def trim(self, n: int) -> int:
        for part in self.packed:
            part.trim(n)
        return super().trim(n)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(part.nbytes for part in self.packed)


class _RoundTripBatch(_RoundTrip):
    """The batch forms: the packed parts follow every change of the rows."""

    def filter(self, batch_indices: Any) -> None:
        for part in self.packed:
            part.filter(batch_indices)
        super().filter(batch_indices)

    def extend(self, other: Any) -> None:
        for part, theirs in zip(self.packed, other.packed):
            part.extend(theirs)
        super().extend(other)

    def prepare(self, **kwargs: Any) -> None:
        for part in self.packed:
            part.prepare(**kwargs)
        super().prepare(**kwargs)

    def finalize(self) -> None:
        for part in self.packed:
            part.finalize()
        super().finalize()


class RoundTripKVCache(_RoundTrip, KVCache):
    """mlx-lm's KVCache (global attention) of a ``--kv-bits`` model."""

    def __init__(self, quant: KvQuantization):
        super().__init__()
        self.quant = quant
        self.packed = [KVCache() for _ in range(NUM_PACKED_PARTS)]

    @classmethod
    def merge(cls, caches: list[Any]) -> "RoundTripBatchKVCache":
        batch = BatchKVCache.merge(caches)
        batch.__class__ = RoundTripBatchKVCache
        batch.quant = caches[0].quant
        batch.packed = [BatchKVCache.merge([c.packed[i] for c in caches]) for i in range(NUM_PACKED_PARTS)]
        return batch


class RoundTripBatchKVCache(_RoundTripBatch, BatchKVCache):
    """mlx-lm's BatchKVCache of RoundTripKVCache rows; made by RoundTripKVCache.merge only."""

    def extract(self, idx: int) -> RoundTripKVCache:
        plain = super().extract(idx)
        cache = RoundTripKVCache(self.quant)
        cache.keys, cache.values, cache.offset = plain.keys, plain.values, plain.offset
        cache.packed = [part.extract(idx) for part in self.packed]
        return cache


class RoundTripWindowKVCache(_RoundTrip, WindowKVCache):
    """A sliding-window layer (window_kv.WindowKVCache) of a ``--kv-bits`` model; its packed parts keep records too."""

    def __init__(self, max_size: int, quant: KvQuantization):
        super().__init__(max_size)
        self.quant = quant
        self.packed = [WindowKVCache(max_size) for _ in range(NUM_PACKED_PARTS)]

    @classmethod
    def merge(cls, caches: list[Any]) -> "RoundTripBatchWindowKVCache":
        batch = WindowKVCache.merge(caches)
        batch.__class__ = RoundTripBatchWindowKVCache
        batch.quant = caches[0].quant
        batch.packed = [WindowKVCache.merge([c.packed[i] for c in caches]) for i in range(NUM_PACKED_PARTS)]
        return batch


class RoundTripBatchWindowKVCache(_RoundTripBatch, BatchWindowKVCache):
    """window_kv.BatchWindowKVCache of RoundTripWindowKVCache rows; made by RoundTripWindowKVCache.merge only."""

    def extract(self, idx: int) -> RoundTripWindowKVCache:
        cache = super().extract(idx)  # a WindowKVCache with its record, made a round-trip one
        cache.__class__ = RoundTripWindowKVCache
        cache.quant = self.quant
        cache.packed = [part.extract(idx) for part in self.packed]
        return cache
