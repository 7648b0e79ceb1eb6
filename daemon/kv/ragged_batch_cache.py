"""One layer of a ragged decode batch: each row keeps its own cache, nothing is padded or merged.

mlx-lm's decode batch (BatchKVCache) copies every row into one buffer per
layer, left-padded to the longest row: a row that joins or leaves makes
every row's KV be copied again, attention computes over every row's padding
and the batch holds rows x the longest row. Here a layer of the batch is
only the list of its rows' own caches (whatever class the row had: a plain
or window cache, a shared-prefix fork, a --kv-bits round-trip cache). The
model's one forward pass for all rows runs its linear layers on the rows
together; at attention each row appends its new key and value to its own
cache and attends over it alone (tail_attention.routed_attention calls
``attend``), through the same routing a solo pass takes, so a row computes
what it would compute decoding alone.

Decode steps only: one new token per row (mlx-lm's masks for several tokens
per row would need a per-row form; prefill passes run per sequence anyway).
Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

# Per-row attention: (queries of one row, its keys, its values, its cache, scale, sinks) -> its output.
RowAttention = Callable[[mx.array, mx.array, mx.array, Any, float, Any], mx.array]


class RaggedLayerCache:
    """The caches of one layer, a row each, in the batch's row order."""

    def __init__(self, rows: list[Any]):
        self.rows = rows
        self._fetched: list[tuple[mx.array, mx.array]] = []

    @property
    def offset(self) -> mx.array:
        """Each row's position (rotary embeddings read it before the update): a vector, as BatchKVCache's."""
        return mx.array([row.offset for row in self.rows])

    def make_mask(self, num_queries: int, *args: Any, **kwargs: Any) -> None:
        """One query per row attends to all of its own keys: no mask (each row's window cache holds its window)."""
        if num_queries != 1:
            raise ValueError(f"a ragged batch runs decode steps only (one token a row), not {num_queries} tokens")
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Each row appends its token's key and value to its own cache; ``attend`` reads what they return."""
        if keys.shape[0] != len(self.rows) or keys.shape[2] != 1:
            raise ValueError(
                f"a ragged batch of {len(self.rows)} rows got keys for {keys.shape[0]} rows of {keys.shape[2]} tokens"
            )
        self._fetched = [row.update_and_fetch(keys[i : i + 1], values[i : i + 1]) for i, row in enumerate(self.rows)]
        # The model hands these on to attention unread; routed_attention recognises this cache and calls attend.
        return keys, values

    def attend(self, queries: mx.array, scale: float, sinks: Any, row_attention: RowAttention) -> mx.array:
        """Attention of every row over its own cache, the rows' outputs stacked in row order."""
        fetched, self._fetched = self._fetched, []
        if len(fetched) != len(self.rows):
            raise RuntimeError("attention over a ragged batch before its rows' keys were appended")
        outputs = [
            row_attention(queries[i : i + 1], keys, values, row, scale, sinks)
            for i, (row, (keys, values)) in enumerate(zip(self.rows, fetched))
        ]
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


def ragged_layers(row_caches: list[list[Any]]) -> list[RaggedLayerCache]:
    """A step's cache for the model: per layer, that layer of every row's cache (rows in order)."""
    return [RaggedLayerCache([cache[i] for cache in row_caches]) for i in range(len(row_caches[0]))]
