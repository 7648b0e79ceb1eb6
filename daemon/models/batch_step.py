"""Which decode batch a model's rows run in (--batch-step): chosen, then checked once at load.

``padded``: mlx-lm's BatchGenerator, rows merged into one left-padded cache.
``ragged``: prefixd's own (engine/ragged_batch.py), each row over its own
cache: no copy when a row joins or leaves, no attention over padding, and
a batch holds only its rows' own tokens (the scheduler reserves so). On
this project's CPU its step cost 1.00-1.14x the padded one with rows of
equal depth and 0.58x with one deep row among short ones; on an H100,
where it makes an attention call per row and layer against the padded
batch's one kernel per layer, 1.3-3.1x (bench/probes/ragged_step_probe.py,
bench/results/2026-12-08-h100-ragged). So ``auto`` is ragged on a CPU and
padded on a GPU (Metal not measured: padded).

A row attends through tail_attention's routing; a model whose attention
does not go through it would attend to its new token only. So before a
model serves, two rows of different depths decode one step as a ragged
batch and alone; if the logits differ, the model's rows stay padded and
the log says why.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..kv.fork import live_cache
from ..kv.layout import CacheLayout
from ..kv.ragged_batch_cache import ragged_layers

MODES = ("auto", "padded", "ragged")

CHECK_DEPTHS = (24, 9)  # two rows' prompts (token ids 3..): different depths, so padding would show
# Relative to the largest logit: float32 agrees to ~1e-6, bfloat16 to ~1e-2; attention over the new
# token alone differs in the leading digit.
CHECK_TOLERANCE = 0.05


def wants_ragged(mode: str, on_gpu: bool) -> bool:
    """``auto``: ragged on a CPU, padded on a GPU (where the per-row calls cost more than the padding)."""
    if mode not in MODES:
        raise ValueError(f"batch step must be one of {', '.join(MODES)}, not {mode!r}")
    return mode == "ragged" or (mode == "auto" and not on_gpu)


def choose_batch_step(model: Any, layout: CacheLayout, wanted: bool) -> str:
    """``ragged`` where wanted and the check agrees; otherwise ``padded``, with why when ragged was wanted."""
    if not wanted:
        return "padded"
    if layout.is_hybrid:
        # mlx-lm's conv/SSM layers read their state as one batched array: such rows stay merged.
        return "padded (conv/SSM state layers decode in mlx-lm's batch)"
    if not layout.is_supported:
        return "padded (cache layers prefixd does not know)"
    try:
        difference = ragged_difference(model, layout)
    except Exception as exc:  # a model whose layers refuse a per-row cache
        return f"padded (a ragged step failed: {type(exc).__name__}: {exc})"
    if difference > CHECK_TOLERANCE:
        return f"padded (a ragged step answered differently: relative difference {difference:.3g})"
    return "ragged"


def ragged_difference(model: Any, layout: CacheLayout) -> float:
    """The largest difference of one step's logits, two rows as a ragged batch against each alone."""
    alone_logits, rows = [], []
    for depth in CHECK_DEPTHS:
        prompt = mx.arange(3, 3 + depth)[None]
        alone, batched = live_cache(model, layout), live_cache(model, layout)
        model(prompt, cache=alone)
        model(prompt, cache=batched)
        next_token = mx.array([[3 + depth]])
        alone_logits.append(model(next_token, cache=alone)[:, -1].astype(mx.float32))
        rows.append(batched)
    inputs = mx.array([[3 + depth] for depth in CHECK_DEPTHS])
    ragged = model(inputs, cache=ragged_layers(rows))[:, -1].astype(mx.float32)
    expected = mx.concatenate(alone_logits)
    scale = max(mx.abs(expected).max().item(), 1e-6)
    return mx.abs(ragged - expected).max().item() / scale
