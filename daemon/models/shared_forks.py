"""Whether a model's cache hits read the stored segments in place (--fork): chosen, then checked once at load.

A shared fork (kv/shared_prefix_cache.py) hands a layer's attention only the
sequence's own keys; the stored pieces come in through tail_attention's
routing. A model whose attention does not go through that routing would
silently attend to its own tokens only, so before a model serves, one short
prompt is answered cold and as a shared fork of its first part, alone and as
two rows of a decode batch. If the logits differ (or the batch cannot run
it: attention sinks), the model copies as before and the log says why.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import mlx.core as mx

from ..kv.fork import capture_segment, capture_snapshot, fork_cache, live_cache
from ..kv.layout import CacheLayout
from ..kv.shared_prefix_cache import SharedPrefixKVCache, batch_rows

MODES = ("auto", "copy", "share")

CHECK_TOKENS = 24  # the check's prompt: token ids 3..26, every vocabulary has them
CHECK_PREFIX = 16  # its first part, stored and then forked
# Relative to the largest logit: float32 agrees to ~1e-6, bfloat16 to ~1e-2; attention
# without the prefix differs in the leading digit.
CHECK_TOLERANCE = 0.05


def wants_shared_forks(mode: str, on_gpu: bool) -> bool:
    """``auto``: share on a CPU, where bench/shared_forks.py measured it to pay; copy on a GPU (not measured yet)."""
    if mode not in MODES:
        raise ValueError(f"fork mode must be one of {', '.join(MODES)}, not {mode!r}")
    return mode == "share" or (mode == "auto" and not on_gpu)


def with_shared_forks(model: Any, layout: CacheLayout, wanted: bool, dtype: Any) -> tuple[CacheLayout, str]:
    """The layout a model serves with, and why forks copy where sharing was wanted."""
    if not wanted:
        return layout, "copy"
    if dtype != mx.float32:
        # Attention over the pieces rounds each piece's share apart: in bfloat16 that changed SmolLM2's
        # greedy answers against a cold run (tests/model/test_bf16_exactness.py), in float32 it does not.
        return layout, f"copy ({str(dtype).replace('mlx.core.', '')}: shared forks are exact in float32 only)"
    if layout.kv_bits:
        return layout, "copy (--kv-bits keeps its round-trip caches)"
    if not layout.is_supported or len(layout.attention_layers) == len(layout.window_layers):
        return layout, "copy (no global attention layer to share)"
    shared = replace(layout, shares_forks=True)
    try:
        difference = _check_difference(model, shared)
    except NotImplementedError as exc:  # attention sinks over shared pieces in a batch
        return layout, f"copy ({exc})"
    if difference is None or difference > CHECK_TOLERANCE:
        return layout, f"copy (a shared fork answered differently: relative difference {difference})"
    return shared, "share"


def _check_difference(model: Any, shared: CacheLayout) -> float | None:
    """The largest difference of the last logits, alone and as two rows of mlx-lm's batch, against a cold run."""
    tokens = mx.arange(3, 3 + CHECK_TOKENS)[None]
    cold = model(tokens, cache=live_cache(model, shared))[:, -1].astype(mx.float32)
    first = live_cache(model, shared)
    model(tokens[:, :CHECK_PREFIX], cache=first)
    segment = capture_segment(first, shared, 0, CHECK_PREFIX)
    snapshot = capture_snapshot(first, shared)

    def fork() -> list[Any]:
        return fork_cache(model, shared, [segment], snapshot, CHECK_PREFIX, share_from=0)

    alone = fork()
    if not any(isinstance(layer, SharedPrefixKVCache) for layer in alone):
        return None
    warm = model(tokens[:, CHECK_PREFIX:], cache=alone)[:, -1].astype(mx.float32)
    # As mlx-lm's decode batch merges rows (generate._merge_caches): each layer by its first row's class.
    rows = [batch_rows(fork(), True) for _ in range(2)]
    batch = [rows[0][i].merge([row[i] for row in rows]) for i in range(len(rows[0]))]
    batched = model(mx.concatenate([tokens[:, CHECK_PREFIX:]] * 2), cache=batch)[:, -1].astype(mx.float32)
    scale = max(mx.abs(cold).max().item(), 1e-6)
    return max(mx.abs(warm - cold).max().item(), mx.abs(batched - cold).max().item()) / scale
