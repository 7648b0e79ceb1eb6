"""Attention over a hit's stored pieces read in place plus the sequence's own keys (kv/shared_prefix_cache.py).

One score matmul per piece, one softmax over all of them joined (so the
result is the attention over the whole sequence, not a merge of partial
ones), one weighted sum per piece. This is the formulation MLX itself runs
on a CPU, where it has no fused kernel: on this project's CPU a pass over
one to eight pieces costs what the fused call on a contiguous cache costs
(within 1.0-1.3x at 1,024-4,096 tokens; bench/probes/shared_prefix_probe.py),
while every further piece adds a matmul pair per layer (36 pieces: 2-6x),
which is why a fork shares at most a few (fork.py).

Every piece lies before every query, so only the own keys take the causal
mask; a single sequence's array mask spans the whole sequence and is split
at the pieces' end; a batch's (mlx-lm's left padding) spans the own keys only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def batch_prefix_attention(
    queries: mx.array,
    row_keys: list[list[mx.array]],
    row_values: list[list[mx.array]],
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Any,
) -> mx.array:
    """A decode batch's attention: each row over its own pieces, then its own (left-padded) keys.

    Rows that read the same pieces (one stored system prompt) go together:
    the pieces have a batch dimension of one, so one matmul broadcasts them
    over those rows. ``mask`` (mlx-lm's batch mask) covers the own keys only.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, pieces in enumerate(row_keys):
        groups.setdefault(tuple(id(piece) for piece in pieces), []).append(row)
    if len(groups) == 1:
        return prefix_attention(queries, row_keys[0], row_values[0], keys, values, scale, mask, mask_spans_pieces=False)
    outputs, order = [], []
    for rows in groups.values():
        index = mx.array(rows)
        row_mask = mask[index] if mask is not None and not isinstance(mask, str) else mask
        outputs.append(
            prefix_attention(
                queries[index],
                row_keys[rows[0]],
                row_values[rows[0]],
                keys[index],
                values[index],
                scale,
                row_mask,
                mask_spans_pieces=False,
            )
        )
        order += rows
    inverse = [0] * len(order)
    for position, row in enumerate(order):
        inverse[row] = position
    return mx.concatenate(outputs, axis=0)[mx.array(inverse)]


def prefix_attention(
    queries: mx.array,
    prefix_keys: list[mx.array],
    prefix_values: list[mx.array],
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Any,
    mask_spans_pieces: bool = True,
) -> mx.array:
    """softmax(q [pieces..., keys]^T * scale + mask) [pieces..., values], grouped-query heads included.

    ``mask_spans_pieces``: an array mask has a column per position of the
    whole sequence (a single sequence's cache), or only for the own keys
    (mlx-lm's batch, whose rows see every piece).
    """
    batch, num_heads, num_queries, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    repeats = num_heads // num_kv_heads
    all_keys, all_values = [*prefix_keys, keys], [*prefix_values, values]
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(batch, num_kv_heads, repeats, num_queries, head_dim)
        all_keys = [mx.expand_dims(k, 2) for k in all_keys]
        all_values = [mx.expand_dims(v, 2) for v in all_values]
    array_mask = mask is not None and not isinstance(mask, str) and mask_spans_pieces
    scores, position = [], 0
    for piece_keys in all_keys[:-1]:
        piece_scores = queries @ piece_keys.swapaxes(-1, -2)
        length = piece_keys.shape[-2]
        if array_mask:  # the columns of this piece's positions
            piece_scores = _apply(piece_scores, _columns(mask, position, position + length, repeats > 1))
        scores.append(piece_scores)
        position += length
    own_start = position if mask_spans_pieces else 0  # where the own keys' columns start in an array mask
    scores.append(_masked_own_scores(queries @ all_keys[-1].swapaxes(-1, -2), mask, own_start, repeats > 1))
    weights = mx.softmax(mx.concatenate(scores, axis=-1), axis=-1, precise=True)
    out, start = None, 0
    for piece_values in all_values:
        length = piece_values.shape[-2]
        part = weights[..., start : start + length] @ piece_values
        out = part if out is None else out + part
        start += length
    if repeats > 1:
        out = out.reshape(batch, num_heads, num_queries, head_dim)
    return out


def _masked_own_scores(scores: mx.array, mask: Any, start: int, grouped: bool) -> mx.array:
    """The own keys' scores under the mask: "causal" is bottom-right aligned (the queries are the last own keys)."""
    if mask is None:
        return scores
    num_queries, num_keys = scores.shape[-2], scores.shape[-1]
    if isinstance(mask, str):
        query_positions = mx.arange(num_keys - num_queries, num_keys)
        return _apply(scores, query_positions[:, None] >= mx.arange(num_keys)[None])
    return _apply(scores, _columns(mask, start, start + num_keys, grouped))


def _columns(mask: mx.array, start: int, end: int, grouped: bool) -> mx.array:
    columns = mask[..., start:end]
    return mx.expand_dims(columns, -3) if grouped and columns.ndim == 4 else columns


def _apply(scores: mx.array, mask: mx.array) -> mx.array:
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask.astype(scores.dtype)
