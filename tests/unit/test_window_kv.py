"""Sliding-window layers (RotatingKVCache) in the prefix store, against mlx-lm's own cache, without the daemon.

The tiny gemma3 (window 32: layers 0, 1, 3, 4 slide, 2 and 5 are global) is
fed in passes of every shape mlx-lm's RotatingKVCache has (a first pass longer
than the window, multi-token passes after it, single-token steps that rotate
it); what capture_segment reads out after each pass is every position's KV,
and a fork at any depth, continued by any pass, gives the very arrays (and
logits) that the cold cache gives from there.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache, make_prompt_cache

from prefixd.daemon.kv.fork import can_capture, capture_segment, fork_cache
from prefixd.daemon.kv.layout import make_cache_layout
from prefixd.daemon.kv.segments import KVSegment
from prefixd.daemon.kv.window_kv import BatchWindowKVCache, WindowKVCache, held_range, window_range
from tests.support.tiny_models import TINY_WINDOW

W = TINY_WINDOW
TOTAL = 3 * W + 8  # 104 positions: 3x the window and more


@pytest.fixture(scope="module")
def gemma3(tiny_gemma3_dir):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_gemma3_dir))
    layout = make_cache_layout(model)
    assert layout.window_layers and layout.window_size == W
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(3, 2000, size=TOTAL + 128)]
    return model, layout, tokens


def feed(model, cache, tokens):
    logits = model(mx.array(tokens)[None], cache=cache)[:, -1, :]
    mx.eval([c.state for c in cache] + [logits])
    return logits


def run_capturing(model, layout, tokens, stops):
    """A cold run with passes ending at ``stops``; the segment captured after each pass, as the store keeps them."""
    cache = make_prompt_cache(model)
    segments, position = [], 0
    for stop in stops:
        feed(model, cache, tokens[position:stop])
        assert can_capture(cache, layout, position)
        segments.append(capture_segment(cache, layout, position, stop))
        position = stop
    return cache, segments


def cut(segments, depth):
    """The stored segments covering exactly the first ``depth`` positions (a match at depth)."""
    out, covered = [], 0
    for segment in segments:
        if covered + segment.num_tokens <= depth:
            out.append(segment)
            covered += segment.num_tokens
        else:
            if depth > covered:
                out.append(segment.split(depth - covered)[0])
            break
    assert sum(s.num_tokens for s in out) == depth
    return out


def ordered(layer_cache):
    """A rotating layer's keys and values in temporal order (mlx-lm's own reordering)."""
    return layer_cache._temporal_order(layer_cache.keys), layer_cache._temporal_order(layer_cache.values)


def full_kv(model, layout, tokens):
    """Every position's KV in one pass: a first pass keeps all of it, even past the window."""
    cache = make_prompt_cache(model)
    feed(model, cache, tokens)
    n = len(tokens)  # a global layer's buffer has spare room after its positions
    return [(cache[i].keys[..., :n, :], cache[i].values[..., :n, :]) for i in layout.attention_layers]


# Pass schedules: a first pass longer than the window, passes of one token
# (in place, rotating) between multi-token ones, a run of single-token decode
# steps past the window, and a plain chunked prefill.
DECODE_LIKE = [W + 13, W + 14, W + 15] + list(range(W + 16, 2 * W + 20)) + [2 * W + 30, TOTAL]
CHUNKED = list(range(16, TOTAL, 16)) + [TOTAL]


@pytest.mark.parametrize("stops", [DECODE_LIKE, CHUNKED], ids=["decode-like", "chunked"])
def test_captured_segments_hold_every_position(gemma3, stops):
    model, layout, tokens = gemma3
    _, segments = run_capturing(model, layout, tokens, stops)
    reference = full_kv(model, layout, tokens[:TOTAL])
    for position, (ref_keys, ref_values) in enumerate(reference):
        keys = mx.concatenate([s.keys[position] for s in segments], axis=2)
        values = mx.concatenate([s.values[position] for s in segments], axis=2)
        assert keys.shape == ref_keys.shape == (1, 2, TOTAL, ref_keys.shape[-1])
        # Other pass splits: the same values up to float32 rounding.
        np.testing.assert_allclose(np.array(keys), np.array(ref_keys), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.array(values), np.array(ref_values), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("depth", [1, 5, W - 1, W, W + 1, W + 13, W + 20, 2 * W + 3, 3 * W, TOTAL])
@pytest.mark.parametrize("next_pass", [1, 7, W + 9])
def test_a_fork_continues_exactly_as_the_cold_cache(gemma3, depth, next_pass):
    """Fork at ``depth`` from what a cold run stored, feed one more pass to both: the same arrays, the same logits."""
    model, layout, tokens = gemma3
    stops = sorted({s for s in (W // 2, W + 13, W + 14, 2 * W + 1) if s < depth} | {depth})
    cold, segments = run_capturing(model, layout, tokens, stops)
    fork = fork_cache(model, layout, segments, None, depth)
    for i in layout.window_layers:
        assert type(fork[i]) is WindowKVCache and fork[i].offset == depth  # a RotatingKVCache that keeps more
        keys, values = ordered(cold[i])
        held = min(depth, W)  # what the window needs from here
        assert np.array_equal(np.array(fork[i].keys), np.array(keys[..., -held:, :]))
        assert np.array_equal(np.array(fork[i].values), np.array(values[..., -held:, :]))
    more = tokens[depth : depth + next_pass]
    cold_logits, fork_logits = feed(model, cold, more), feed(model, fork, more)
    assert np.array_equal(np.array(cold_logits), np.array(fork_logits)), (depth, next_pass)
    for i in layout.attention_layers:
        assert fork[i].offset == cold[i].offset == depth + next_pass
        if i in layout.window_layers:  # same slots after the pass: in order, or rotated alike
            assert fork[i].keys.shape == cold[i].keys.shape and fork[i]._idx == cold[i]._idx
            assert np.array_equal(np.array(fork[i].keys), np.array(cold[i].keys))
            assert np.array_equal(np.array(fork[i].values), np.array(cold[i].values))
    # and single-token decode steps after that, past another window
    for step in range(W + 3):
        token = tokens[depth + next_pass + step : depth + next_pass + step + 1]
        assert np.array_equal(np.array(feed(model, cold, token)), np.array(feed(model, fork, token))), step


@pytest.mark.parametrize("depth", [W + 5, 2 * W + 7])
def test_a_fork_from_other_pass_splits_matches_a_cold_run(gemma3, depth):
    """Stored by a decode-like run, reused by a prompt cut elsewhere: the logits of a cold run of that prompt."""
    model, layout, tokens = gemma3
    _, segments = run_capturing(model, layout, tokens, DECODE_LIKE)
    prompt = tokens[:depth] + tokens[TOTAL : TOTAL + 20]
    fork = fork_cache(model, layout, cut(segments, depth), None, depth)
    warm = np.array(feed(model, fork, prompt[depth:]))
    cold = np.array(feed(model, make_prompt_cache(model), prompt))
    assert np.max(np.abs(warm - cold)) / np.max(np.abs(cold)) < 1e-4


def test_held_range_reads_every_shape_of_the_live_window(gemma3):
    model, layout, tokens = gemma3
    i = layout.window_layers[0]
    cache = make_prompt_cache(model)
    assert held_range(cache[i]) == (0, 0)
    feed(model, cache, tokens[:10])  # growing: fewer than W positions
    assert held_range(cache[i]) == (0, 10)
    feed(model, cache, tokens[10:11])  # an in-place step while growing (spare slots after it)
    assert held_range(cache[i]) == (0, 11) and cache[i].keys.shape[2] > 11
    feed(model, cache, tokens[11 : 11 + W])  # in order, more than W: all 11 kept, then the pass
    assert held_range(cache[i]) == (0, 11 + W)
    feed(model, cache, tokens[11 + W : 21 + W])  # in order: the last W - 1 before the pass, then the pass
    assert held_range(cache[i]) == (21 + W - (W - 1) - 10, 21 + W)
    for step in range(5):  # rotated: W slots, the oldest at _idx
        feed(model, cache, tokens[21 + W + step : 22 + W + step])
        assert cache[i].keys.shape[2] == W and cache[i]._idx == step + 1
        assert held_range(cache[i]) == (22 + step, 22 + W + step)
        keys, _ = window_range(cache[i], 22 + step, 22 + W + step)
        assert np.array_equal(np.array(keys), np.array(cache[i]._temporal_order(cache[i].keys)))
    assert window_range(cache[i], 0, 30) is None and window_range(cache[i], 26, 26 + W) is not None
    assert not can_capture(cache, layout, 25) and can_capture(cache, layout, 26)


def test_batched_rows_merge_and_extract_like_cold_ones(gemma3):
    """mlx-lm's batch (merge, decode steps, extract) treats a fork as it treats the cold cache it stands for."""
    model, layout, tokens = gemma3
    depths = [W + 13, 2 * W + 1, 7]
    colds, forks = [], []
    for n, depth in enumerate(depths):
        cold, segments = run_capturing(model, layout, tokens[n:], sorted({min(W // 2, depth), depth}))
        colds.append(cold)
        forks.append(fork_cache(model, layout, segments, None, depth))
    merged = {name: [type(layer).merge([c[i] for c in caches]) for i, layer in enumerate(caches[0])]
              for name, caches in (("cold", colds), ("fork", forks))}
    step = mx.array([[tokens[50 + n]] for n in range(len(depths))])
    for _ in range(W + 4):  # past the window: the batch rotates
        outs = {name: model(step, cache=cache)[:, -1, :] for name, cache in merged.items()}
        mx.eval(list(outs.values()))
        assert np.array_equal(np.array(outs["cold"]), np.array(outs["fork"]))
        step = mx.argmax(outs["cold"], axis=-1)[:, None]
    for n, depth in enumerate(depths):
        for name, cache in merged.items():
            row = [layer.extract(n) for layer in cache]
            for i in layout.window_layers:
                assert isinstance(cache[i], BatchRotatingKVCache) and row[i].offset == depth + W + 4
                first, end = held_range(row[i])
                assert end == depth + W + 4 and end - first == min(end, W)
                assert window_range(row[i], end - W + 1, end) is not None
            assert all(isinstance(row[i], KVCache) for i in layout.attention_layers if i not in layout.window_layers)


def test_segment_bytes_count_every_position_of_window_layers(gemma3):
    model, layout, tokens = gemma3
    _, segments = run_capturing(model, layout, tokens, [TOTAL])
    (segment,) = segments
    per_token_layer = 2 * 2 * (256 // 4) * 4  # keys + values, 2 KV heads, head_dim 64, float32
    assert isinstance(segment, KVSegment) and segment.num_tokens == TOTAL
    assert segment.nbytes == TOTAL * len(layout.attention_layers) * per_token_layer


@pytest.mark.parametrize("fresh", [True, False], ids=["prompt-pass-then-decode", "fork-then-decode"])
def test_decode_past_the_window_keeps_every_position_for_storing(gemma3, fresh):
    """What the window drops while decoding stays in the WindowKVCache's record, bit for bit."""
    model, layout, tokens = gemma3
    depth = W + 8
    if fresh:  # a prefill whose last pass fed the prompt's last token: stored up to the one before it
        cache = fork_cache(model, layout, [], None, 0)
        feed(model, cache, tokens[: depth + 1])
        start, position = depth, depth + 1
    else:  # an exact hit: the fork at len - 1, then the last prompt token as a single step
        _, segments = run_capturing(model, layout, tokens, [W // 2, depth])
        cache = fork_cache(model, layout, segments, None, depth)
        start = position = depth
    assert can_capture(cache, layout, start)
    fresh_kv = {}  # each position's KV read from the live window right after it was fed
    for _ in range(2 * W + 5):
        feed(model, cache, tokens[position : position + 1])
        fresh_kv[position] = capture_segment(cache, layout, position, position + 1)
        position += 1
    i = layout.window_layers[0]
    assert held_range(cache[i])[0] > start  # the window has moved past what is to be stored
    assert can_capture(cache, layout, start) and not can_capture(cache, layout, start - 1)
    segment = capture_segment(cache, layout, start, position)
    assert segment.num_tokens == position - start
    for p, one in fresh_kv.items():
        for n in range(len(layout.attention_layers)):
            assert np.array_equal(np.array(segment.keys[n][..., p - start : p - start + 1, :]), np.array(one.keys[n]))
            assert np.array_equal(np.array(segment.values[n][..., p - start : p - start + 1, :]), np.array(one.values[n]))
    # a step trimmed off (the batch's hand-over to the solo path) leaves the record too
    for n in layout.window_layers:
        cache[n].trim(1)
    assert can_capture(cache, layout, start) and len(cache[i].kept) == cache[i].offset - cache[i].kept_from
    # a multi-token pass starts the record over at its last position
    feed(model, cache, tokens[position - 1 : position + 9])
    assert cache[i].kept_from == position + 8 and not can_capture(cache, layout, start)


def test_rows_decoded_in_the_batch_keep_their_records_through_filter_extend_and_extract(gemma3):
    """Merged forks decode past the window in mlx-lm's batch; each extracted row can still store its whole answer."""
    model, layout, tokens = gemma3
    depths = [W + 5, 9, 2 * W]
    forks = []
    for n, depth in enumerate(depths):
        cache = fork_cache(model, layout, [], None, 0)
        feed(model, cache, tokens[n : n + depth])
        forks.append(cache)
    merged = [type(layer).merge([c[i] for c in forks[:2]]) for i, layer in enumerate(forks[0])]
    late = [type(layer).merge([forks[2][i]]) for i, layer in enumerate(forks[2])]
    i = layout.window_layers[0]
    assert type(merged[i]) is BatchWindowKVCache and type(late[i]) is BatchWindowKVCache

    def step(batch, rows):
        out = model(mx.array([[tokens[100 + r]] for r in rows]), cache=batch)[:, -1, :]
        mx.eval(out)

    for _ in range(W // 2):
        step(merged, [0, 1])
    for _ in range(3):
        step(late, [2])
    for a, b in zip(merged, late):  # a row joins the running batch
        a.extend(b)
    for _ in range(W + 6):
        step(merged, [0, 1, 2])
    for layer in merged:  # row 1 finishes
        layer.filter([0, 2])
    for _ in range(4):
        step(merged, [0, 2])
    steps = {0: W // 2 + W + 10, 2: 3 + W + 10}
    for row, n in ((0, 0), (1, 2)):
        extracted = [layer.extract(row) for layer in merged]
        start, end = depths[n] - 1, depths[n] + steps[n]
        assert type(extracted[i]) is WindowKVCache and extracted[i].offset == end
        assert held_range(extracted[i])[0] > start and can_capture(extracted, layout, start)
        segment = capture_segment(extracted, layout, start, end)
        for k in layout.window_layers:  # where the record and the window overlap they agree bit for bit
            window_keys, _ = window_range_of_window(extracted[k], end - W, end)
            position = layout.attention_layers.index(k)
            assert np.array_equal(np.array(segment.keys[position][..., -W:, :]), np.array(window_keys))
        solo = fork_cache(model, layout, [], None, 0)  # the same row decoded alone: the same KV, up to rounding
        feed(model, solo, tokens[n : n + depths[n]])
        for _ in range(steps[n]):
            feed(model, solo, [tokens[100 + n]])
        alone = capture_segment(solo, layout, start, end)
        for a, b in zip(alone.keys + alone.values, segment.keys + segment.values):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


def window_range_of_window(layer_cache, start, end):
    """Keys/values of [start, end) read from the live window alone (not from a record)."""
    kept, layer_cache.kept = layer_cache.kept, []
    try:
        return window_range(layer_cache, start, end)
    finally:
        layer_cache.kept = kept


def test_a_row_merged_from_a_plain_cache_stores_only_what_its_window_holds(gemma3):
    model, layout, tokens = gemma3
    plains = []
    for n in range(2):
        cache = make_prompt_cache(model)
        feed(model, cache, tokens[n : n + W])
        plains.append(cache)
    merged = [type(layer).merge([c[i] for c in plains]) for i, layer in enumerate(plains[0])]
    for step in range(W + 2):
        mx.eval(model(mx.array([[tokens[80 + step]], [tokens[90 + step]]]), cache=merged)[:, -1, :])
    row = [layer.extract(0) for layer in merged]
    i = layout.window_layers[0]
    assert type(row[i]) is RotatingKVCache and row[i].offset == 2 * W + 2
    assert not can_capture(row, layout, W - 1) and can_capture(row, layout, W + 2)
