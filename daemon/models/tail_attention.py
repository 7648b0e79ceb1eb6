"""Attention for short multi-token passes (a cache hit's tail) without a per-shape build on CUDA.

Why: MLX's CUDA backend runs a multi-token ``mx.fast.scaled_dot_product_attention``
through cuDNN, and builds a cuDNN graph for every new (query length, key
length, strides) it meets, caching it by exactly those shapes
(mlx/backend/cuda/scaled_dot_product_attention.cpp: ``build_sdpa_cache_key``).
A build costs tens of milliseconds on a GPU (bench/probes/shape_probe.py). A daemon
serving cache hits meets a new pair on nearly every request: the next chat turn
or the next editor edit is a tail of a new length at a new cache depth. The
build then costs more than the prefill the cache saved.

A tail is short, so the plain formulation (two matmuls and a softmax, the same
one MLX falls back to where it has no fused kernel) is cheap there and has no
per-shape build: cuBLAS picks a kernel per shape in microseconds. Long passes
(a cold prompt's full chunks) keep the fused kernel: their score matrix would
be large, and their shapes repeat (chunk after chunk of the same length).

Decode steps (one query token) keep MLX's vector kernel and its cuDNN decode
path, built once per 256 keys, not per length; except a decode batch's step
over left-padded rows in mode ``kernel`` (``auto`` on CUDA): MLX has no fused
kernel for its array mask, so such a step goes to prefixd's own
(padded_decode_attention.py), where that kernel builds and agrees with MLX.
A sequence decoding alone has no mask and keeps MLX's kernel, which was the
faster of the two there at every depth measured.

A tail's first pass still costs more than its repeats in this form, but less
than fused, and what is left depends on the pass's length alone, not the cache
depth; padding passes to a few lengths does not pay for itself (the figures,
and what was tried: docs/decisions.md).

A hit's cache that reads the stored segments in place (kv/shared_prefix_cache.py)
hands attention only its own keys; this routing adds the stored pieces
(prefix_attention.py), so such a cache works only in models routed here
(loaded_model checks that a shared fork answers as a copied one does).

The policy is process-wide because mlx-lm's model modules bind
``scaled_dot_product_attention`` by name at import; ``install`` rebinds that
name in the modules a loaded model's layers come from.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import structlog

from ..cuda import choose_form
from ..kv.ragged_batch_cache import RaggedLayerCache
from ..kv.shared_prefix_cache import SharedPrefixBatchKVCache, SharedPrefixKVCache
from . import padded_decode_attention
from .prefix_attention import batch_prefix_attention, prefix_attention

# fused: MLX's attention everywhere; matmul: short tails in the plain form; kernel: that,
# and a padded decode batch's steps through padded_decode_attention.py.
MODES = ("auto", "fused", "matmul", "kernel")

# Above this many attention scores (batch x heads x queries x keys) a pass keeps
# the fused kernel: 64M float32 scores are 256 MiB, and such a pass is long
# enough that a graph build is a small part of it.
MAX_MATMUL_SCORES = 1 << 26

log = structlog.get_logger()

_state = {"mode": "fused", "matmul_passes": 0, "kernel_steps": 0}


def resolve_mode(mode: str) -> str:
    """``auto``: on a CUDA GPU the matmul form for short tails and the padded-decode kernel; fused elsewhere."""
    return choose_form(mode, MODES, "attention mode", on_cuda_form="kernel", elsewhere="fused")


def install(model: Any, mode: str) -> str:
    """Route the model's short multi-token attention by ``mode``; returns the mode in effect.

    ``kernel`` becomes ``matmul`` (logged) where the padded-decode kernel does
    not build or does not agree with MLX's masked attention (a CPU, Metal).
    """
    from mlx_lm.models import base

    mode = resolve_mode(mode)
    if mode == "kernel":
        shapes = padded_decode_attention.attention_shapes(model)
        ok, why = padded_decode_attention.agrees(shapes or None, _model_dtype(model))
        if not ok:
            log.warning("padded_decode_kernel_unavailable", reason=why, using="matmul")
            mode = "matmul"
    _state["mode"] = mode
    module_names = {type(layer).__module__ for layer in _submodules(model)}
    for name in module_names:
        module = sys.modules.get(name)
        bound = getattr(module, "scaled_dot_product_attention", None)
        if bound is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = routed_attention
    return _state["mode"]


def matmul_passes() -> int:
    """How many attention calls took the matmul form (a figure for benchmarks and tests)."""
    return _state["matmul_passes"]


def _model_dtype(model: Any) -> mx.Dtype:
    """The dtype the model's activations (and so its queries) take: its first floating parameter's."""
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def kernel_steps() -> int:
    """How many attention calls went to the padded-decode kernel (a figure for benchmarks)."""
    return _state["kernel_steps"]


def _submodules(model: Any) -> list[Any]:
    modules = getattr(model, "modules", None)
    return list(modules()) if callable(modules) else [model]


def routed_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention`` with short multi-token passes in the matmul form."""
    from mlx_lm.models import base

    if isinstance(cache, RaggedLayerCache):  # a ragged decode batch: each row attends over its own cache, routed here
        return cache.attend(queries, scale, sinks, _row_attention)
    if isinstance(cache, SharedPrefixKVCache) and cache.prefix_len:
        if sinks is None:
            return prefix_attention(queries, cache.prefix_keys, cache.prefix_values, keys, values, scale, mask)
        # No sink term in the plain form: the fused kernel on a joined copy (no model prefixd serves has sinks).
        keys = mx.concatenate([*cache.prefix_keys, keys], axis=2)
        values = mx.concatenate([*cache.prefix_values, values], axis=2)
    if isinstance(cache, SharedPrefixBatchKVCache) and cache.has_pieces:
        if sinks is not None:
            raise NotImplementedError("attention sinks over shared stored pieces (no model prefixd serves has them)")
        return batch_prefix_attention(queries, cache.row_keys, cache.row_values, keys, values, scale, mask)
    if _state["mode"] == "kernel" and padded_decode_attention.applies(queries, keys, values, cache, sinks, mask):
        _state["kernel_steps"] += 1
        starts = padded_decode_attention.row_starts(cache, queries.shape[0])
        return padded_decode_attention.attention(queries, keys, values, starts, scale)
    if _takes_matmul(queries, keys, cache, sinks):
        _state["matmul_passes"] += 1
        return matmul_attention(queries, keys, values, scale, mask)
    return base.scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def _row_attention(queries, keys, values, cache, scale: float, sinks) -> mx.array:
    """One row of a ragged decode batch, as a sequence decoding alone attends (one query: no mask)."""
    return routed_attention(queries, keys, values, cache, scale, None, sinks)


def _takes_matmul(queries, keys, cache, sinks) -> bool:
    if _state["mode"] not in ("matmul", "kernel") or sinks is not None or hasattr(cache, "bits"):
        return False
    batch, heads, num_queries, _ = queries.shape
    if num_queries < 2:
        return False
    return batch * heads * num_queries * keys.shape[-2] <= MAX_MATMUL_SCORES


def matmul_attention(queries, keys, values, scale: float, mask) -> mx.array:
    """softmax(q k^T * scale + mask) v, grouped-query heads included; a "causal" mask is bottom-right aligned."""
    batch, num_heads, num_queries, head_dim = queries.shape
    num_kv_heads = keys.shape[-3]
    repeats = num_heads // num_kv_heads
    queries = queries * scale
    if repeats > 1:
        queries = queries.reshape(batch, num_kv_heads, repeats, num_queries, head_dim)
        keys = mx.expand_dims(keys, -3)
        values = mx.expand_dims(values, -3)
    scores = queries @ keys.swapaxes(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            num_keys = scores.shape[-1]
            query_positions = mx.arange(num_keys - num_queries, num_keys)
            mask = query_positions[:, None] >= mx.arange(num_keys)[None]
        elif repeats > 1 and mask.ndim == 4:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights @ values
    if repeats > 1:
        out = out.reshape(batch, num_heads, num_queries, -1)
    return out
