"""Build at load what a model's first cache hits would otherwise build while a client waits (a GPU).

On CUDA, MLX replays each evaluation's kernels as CUDA graphs, instantiated
the first time a graph topology is met and cached per stream after that
(mlx/backend/cuda/device.cpp). A fork of S stored segments has one topology
per S (kv/fork.py, ``evaluate_fork``), and the forward pass of a prompt's last
token on a fork has its own (decode steps run on the decode batch's stream,
whose graphs do not serve the prefill stream). In a fresh daemon on an H200,
each exact hit at a segment count not met before cost 14-19 ms more than its
repeats (bench/first_hit_probe.py, 2026-12-04): the first repeat of the repeat
workload, the first hit after a restart, the first two-chunk prompt.

So a model's load ends with forks of 1 to ``WARM_SEGMENTS`` segments of a few
made-up tokens, each followed by the last-token pass and its sampling, the
way start_prefill and last_token_logits run them. Nothing reaches the prefix
store. ``auto`` warms up on a GPU only: a CPU builds no graphs, and compiles
nothing per shape that this would catch.
"""

from __future__ import annotations

import time
from typing import Any, Generator

import mlx.core as mx

from ..kv.fork import capture_segment, capture_snapshot, evaluate_fork, fork_cache
from ..models.loaded_model import LoadedModel

MODES = ("auto", "on", "off")
# Stored prefixes of up to this many segments are forked once at load. A
# segment is a prefill chunk, a chat message's end or an answer, so this covers
# repeated prompts, file contexts and the first turns of a chat.
WARM_SEGMENTS = 8
SEGMENT_TOKENS = 16


def resolve_mode(mode: str, on_gpu: bool) -> bool:
    if mode not in MODES:
        raise ValueError(f"warm-up must be one of {', '.join(MODES)}, not {mode!r}")
    return mode == "on" or (mode == "auto" and on_gpu)


def warm_up_steps(loaded: LoadedModel) -> Generator[None, None, float]:
    """Fork and run the last-token pass for each segment count; yields between forks, returns the seconds taken.

    Engine thread (MLX arrays belong to the thread that made them).
    """
    model, layout = loaded.model, loaded.layout
    if not layout.is_supported:
        return 0.0  # no fork is ever made for it
    started = time.perf_counter()
    tokens = _made_up_tokens(loaded, WARM_SEGMENTS * SEGMENT_TOKENS + 1)
    cache = fork_cache(model, layout, [], None, 0)
    segments, snapshots = [], []
    for start in range(0, WARM_SEGMENTS * SEGMENT_TOKENS, SEGMENT_TOKENS):
        model(mx.array(tokens[start : start + SEGMENT_TOKENS])[None], cache=cache)
        mx.eval([c.state for c in cache])
        segments.append(capture_segment(cache, layout, start, start + SEGMENT_TOKENS))
        snapshots.append(capture_snapshot(cache, layout))
    yield
    for count in range(1, WARM_SEGMENTS + 1):
        length = count * SEGMENT_TOKENS
        fork = fork_cache(model, layout, segments[:count], snapshots[count - 1], length)
        evaluate_fork(fork)
        logits = model(mx.array(tokens[length : length + 1])[None], cache=fork)[:, -1, :]
        mx.eval(logits)
        mx.eval(mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1))
        yield
    return time.perf_counter() - started


def run_all(steps: Generator[None, None, Any]) -> Any:
    """A generator's steps back to back; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _made_up_tokens(loaded: LoadedModel, count: int) -> list[int]:
    """Ordinary text's token ids (any ids would do: only shapes matter here)."""
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False) or [0]
    return (ids * (count // len(ids) + 1))[:count]
