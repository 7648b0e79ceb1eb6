"""Live mlx-lm caches to and from store payloads: capture what a prefill computed, fork a hit.

A fork never writes into the store's arrays (a shared fork reads them in
place: shared_prefix_cache.py), and a capture never aliases the live cache,
so writing to either never changes the other (tests pin this). A
``--kv-bits`` model's live caches are round_trip_cache.py's: a fork
dequantizes the stored segments for attention and keeps their packed form
beside them; a capture takes the packed form the live cache kept.
Engine thread only: every function here makes MLX calls.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from ..cuda import on_cuda
from .layout import CacheLayout
from .quantized_kv import KvQuantization
from .round_trip_cache import NUM_PACKED_PARTS, RoundTripKVCache, RoundTripWindowKVCache
from .segments import KVSegment, StateSnapshot
from .shared_prefix_cache import SharedPrefixKVCache
from .window_kv import fill_window, window_cache, window_range

# Spare room given to a forked attention cache, so the first tokens appended
# after a hit write in place instead of triggering a second full copy.
FORK_HEADROOM_TOKENS = 256
# A shared fork (layout.shares_forks) reads stored segments of at least this many tokens in place and
# joins each run of shorter ones (a chat's messages and answers) into one copied piece: every piece
# costs attention a matmul pair per layer and step (models/prefix_attention.py).
SHARED_PIECE_MIN_TOKENS = 128
# More pieces than this and the fork copies, as without sharing (36 short pieces: a step's attention
# 2-6x). A 2,432-token prompt stored in passes that shortened with depth (about ten, six of them under
# 256 tokens): 128 and 12 read all of it in place (8 sessions: 122 MiB held against 506 with 256 and 8,
# decode within the spread of copying; bench/shared_forks.py).
MAX_SHARED_PIECES = 12
# ... unless the pieces average this many tokens or more: there each one's matmul pair is a small part of
# its work (this CPU, SmolLM2, one decode step over 8,192 tokens: 16 pieces 1.00x one contiguous cache,
# 16,384 in 32 pieces 0.79x; bench/probes/shared_prefix_probe.py). Prompts the pass limit cut are stored
# in chunks of this size (prefill.prefill_step).
LONG_SHARED_PIECE_TOKENS = 512
# A shorter hit copies: there the copy is cheap and the plain attention over pieces is not (SmolLM2, this
# CPU, 4 sessions on one stored prompt: decode 7% slower sharing 532 tokens, 18% faster sharing 1,232;
# bench/shared_forks.py).
SHARED_FORK_MIN_TOKENS = 1024
# On CUDA a fork joins its stored segments at most this many at a time (_join_in_groups).
FORK_GROUP = 8
# None: group on CUDA only (where an evaluation's CUDA graphs are cached by
# topology); tests set True or False.
GROUPED_FORK: bool | None = None


def can_capture(cache: list[Any], layout: CacheLayout, start: int) -> bool:
    """Whether the live cache still holds every position from ``start`` on.

    Global attention layers always do; a sliding window drops positions
    ``window`` steps after they were fed, and keeps them aside only while its
    record holds (window_kv.WindowKVCache: not for a row whose prompt tail
    was fed in mlx-lm's batch), so such an answer longer than the window can
    no longer be stored whole.
    """
    return all(
        window_range(layer, start, layer.offset) is not None
        for i in layout.window_layers
        for layer in ([cache[i], *cache[i].packed] if layout.kv_bits else [cache[i]])
    )


def capture_segment(cache: list[Any], layout: CacheLayout, start: int, end: int) -> KVSegment | None:
    """Copy positions [start, end) of the live cache's attention layers out for storing (see can_capture)."""
    if end <= start:
        return None
    keys, values = [], []
    windows = set(layout.window_layers)
    for i in layout.attention_layers:
        # A --kv-bits model's packed form, which the live cache kept: never a re-quantization (quantized_kv.py).
        parts = cache[i].packed if layout.kv_bits else [cache[i]]
        ranges = [
            window_range(part, start, end)
            if i in windows
            else part.positions(start, end)
            if isinstance(part, SharedPrefixKVCache)
            else (part.keys[..., start:end, :], part.values[..., start:end, :])
            for part in parts
        ]
        layer_keys = tuple(mx.contiguous(k) for k, _ in ranges)
        layer_values = tuple(mx.contiguous(v) for _, v in ranges)
        keys.append(layer_keys if layout.kv_bits else layer_keys[0])
        values.append(layer_values if layout.kv_bits else layer_values[0])
    mx.eval(keys, values)
    return KVSegment(keys, values, end - start, layout.kv_bits)


def capture_snapshot(cache: list[Any], layout: CacheLayout) -> StateSnapshot | None:
    """Snapshot the non-trimmable layers at the cache's current depth (None if there are none).

    mlx-lm replaces an ArraysCache's arrays rather than writing into them, so
    holding references would already be safe; new array objects make the
    snapshot immune to an in-place write on the live cache as well.
    """
    if not layout.is_hybrid:
        return None
    states = [[None if a is None else mx.array(a) for a in cache[i].cache] for i in layout.state_layers]
    # Evaluated now: an unevaluated copy keeps its input alive, and the input
    # of a row's state is a view of the whole decode batch's array.
    mx.eval([a for layer in states for a in layer if a is not None])
    return StateSnapshot(states)


def live_cache(model: Any, layout: CacheLayout) -> list[Any]:
    """An empty live cache for ``model``: mlx-lm's, with prefixd's window layers and, under --kv-bits, round-trip ones."""
    cache = make_prompt_cache(model)
    quant = layout.quantization
    windows = set(layout.window_layers)
    for layer_index in layout.attention_layers:
        if layer_index in windows:  # the same class, plus a record of what decode drops (window_kv.py)
            cache[layer_index] = (
                window_cache(layout.window_size) if quant is None else RoundTripWindowKVCache(layout.window_size, quant)
            )
        elif quant is not None:
            cache[layer_index] = RoundTripKVCache(quant)
    return cache


def _layer_pieces(segments: list[KVSegment], position: int, quant: KvQuantization | None) -> list[list[mx.array]]:
    """[keys, values] of one global layer, one piece per segment; under --kv-bits each packed part's keys and
    values (the order of RoundTripKVCache's ``packed``), which the fork dequantizes once joined."""
    if quant is None:
        return [[s.keys[position] for s in segments], [s.values[position] for s in segments]]
    pieces = []
    for part in range(NUM_PACKED_PARTS):
        pieces += [[s.keys[position][part] for s in segments], [s.values[position][part] for s in segments]]
    return pieces


def _with_headroom(pieces: list[mx.array]) -> mx.array:
    batch, heads, _, dim = pieces[0].shape
    return mx.concatenate([*pieces, mx.zeros((batch, heads, FORK_HEADROOM_TOKENS, dim), pieces[0].dtype)], axis=2)


def fork_cache(
    model: Any,
    layout: CacheLayout,
    segments: list[KVSegment],
    snapshot: StateSnapshot | None,
    length: int,
    share_from: int | None = None,
) -> list[Any]:
    """A fresh live cache holding the first ``length`` tokens of a stored prefix.

    ``share_from``: the shortest hit a sharing layout reads in place (default SHARED_FORK_MIN_TOKENS).

    Writing to the fork never changes a stored entry (tests pin this): a
    copying fork gives attention layers new arrays built by concatenation; a
    shared one (layout.shares_forks) reads the stored arrays in place and
    writes only into buffers of its own (shared_prefix_cache.py); state layers
    get new array objects either way.
    """
    cache = live_cache(model, layout)
    if length == 0:
        return cache
    assert sum(s.num_tokens for s in segments) == length, "segments must cover the prefix exactly"
    assert snapshot is not None or not layout.is_hybrid, "a hybrid fork needs a state snapshot"
    assert all(s.bits == layout.kv_bits for s in segments), "segments stored at another --kv-bits"
    quant = layout.quantization
    windows = set(layout.window_layers)
    full = [
        (position, layer_index)
        for position, layer_index in enumerate(layout.attention_layers)
        if layer_index not in windows
    ]
    for position, layer_index in enumerate(layout.attention_layers):
        if layer_index in windows:
            cache[layer_index] = _fork_window(layout.window_size, segments, position, length, quant)
    shortest = SHARED_FORK_MIN_TOKENS if share_from is None else share_from
    shares = layout.shares_forks and quant is None and length >= shortest
    groups = _shared_groups(segments) if shares else None
    if groups is not None:
        # A short last piece (the prompt's last token, stored alone with its logits: prefill.store_prompt_end)
        # goes into the fork's own buffer: as a piece of its own it would cost every step a matmul pair per layer.
        tail = groups.pop() if len(groups) > 1 and _tokens(groups[-1]) < SHARED_PIECE_MIN_TOKENS else []
        # What the store holds itself; a joined run is this fork's own copy.
        in_store = sum(group[0].num_tokens for group in groups if len(group) == 1)
        for position, layer_index in full:
            layer = cache[layer_index] = _shared_layer(groups, position, in_store)
            if tail:
                layer.update_and_fetch(
                    _joined([s.keys[position] for s in tail]), _joined([s.values[position] for s in tail])
                )
        _restore_states(cache, layout, snapshot)
        return cache
    # Per global layer, the arrays its live cache holds, each as one piece per segment (_layer_pieces).
    pieces = [_layer_pieces(segments, position, quant) for position, _ in full]
    parts = [part for layer in pieces for part in layer]
    if len(segments) > FORK_GROUP and (GROUPED_FORK if GROUPED_FORK is not None else on_cuda()):
        parts = _join_in_groups(parts)
    per_layer = len(pieces[0]) if pieces else 0
    for index, (_, layer_index) in enumerate(full):
        arrays = [_with_headroom(part) for part in parts[index * per_layer : (index + 1) * per_layer]]
        layer_cache = cache[layer_index]
        if quant is None:
            layer_cache.keys, layer_cache.values = arrays
        else:
            for part, keys, values in zip(layer_cache.packed, arrays[0::2], arrays[1::2]):
                part.keys, part.values, part.offset = keys, values, length
            # Dequantized with the headroom (zeros: code 0, scale 0, bias 0 give 0): one pass writes the
            # live buffer, instead of a dequantized copy per segment and a concatenation of them.
            layer_cache.keys = quant.dequantize(tuple(arrays[0::2]))
            layer_cache.values = quant.dequantize(tuple(arrays[1::2]))
        layer_cache.offset = length
    _restore_states(cache, layout, snapshot)
    return cache


def read_stored_prefix_in_place(cache: list[Any], layout: CacheLayout, segments: list[KVSegment], length: int) -> int:
    """Swap a live cache's own copy of its first ``length`` positions for the store's arrays of them.

    Why: a prompt computed here (cold, or after a hit that copied) is stored
    as copies, leased while its sequence runs, so until the answer ends its
    KV is held twice: once in the store, once in the live cache. On a layout
    that shares forks the live cache then reads the stored segments in place,
    as a shared fork would, and keeps only the positions after ``length`` (the
    last prompt token, then the answer). In mlx-lm's decode batch the rows'
    own positions are what is padded, so a long cold row no longer pads every
    other row to its length either. Global attention layers only: windows and
    state layers stay as they are. Returns how many positions it now reads
    from the store's own arrays (0: the cache was left as it was).
    """
    windows = set(layout.window_layers)
    full = [i for i in layout.attention_layers if i not in windows]
    if not layout.shares_forks or layout.kv_bits or not full or length <= 0:
        return 0
    if sum(s.num_tokens for s in segments) != length:
        raise ValueError("the segments must cover the prefix exactly")
    if any(type(cache[i]) is not KVCache or cache[i].keys is None or cache[i].offset < length for i in full):
        return 0  # a shared fork already, or a cache that does not hold the prefix
    groups = _shared_groups(segments)
    if groups is None:
        return 0
    in_store = sum(group[0].num_tokens for group in groups if len(group) == 1)
    if not in_store:
        return 0  # only short pieces: reading them would mean copies of their own
    for position, layer_index in enumerate(layout.attention_layers):
        if layer_index not in full:
            continue
        own = cache[layer_index]
        shared = _shared_layer(groups, position, in_store)
        if own.offset > length:
            shared.update_and_fetch(own.keys[..., length : own.offset, :], own.values[..., length : own.offset, :])
        cache[layer_index] = shared
    mx.eval([cache[i].state for i in full])  # the own positions copied out, so the old buffers can go now
    return in_store


def _restore_states(cache: list[Any], layout: CacheLayout, snapshot: StateSnapshot | None) -> None:
    if snapshot is not None:
        for position, layer_index in enumerate(layout.state_layers):
            cache[layer_index].cache = [None if a is None else mx.array(a) for a in snapshot.states[position]]


def _tokens(group: list[KVSegment]) -> int:
    return sum(s.num_tokens for s in group)


def _shared_groups(segments: list[KVSegment]) -> list[list[KVSegment]] | None:
    """The pieces a shared fork reads: long segments alone, each run of short ones joined; None: too many, too short."""
    groups: list[list[KVSegment]] = []
    for segment in segments:
        short = segment.num_tokens < SHARED_PIECE_MIN_TOKENS
        if short and groups and sum(s.num_tokens for s in groups[-1]) < SHARED_PIECE_MIN_TOKENS:
            groups[-1].append(segment)
        else:
            groups.append([segment])
    most = max(MAX_SHARED_PIECES, sum(s.num_tokens for s in segments) // LONG_SHARED_PIECE_TOKENS)
    return groups if len(groups) <= most else None


def _shared_layer(groups: list[list[KVSegment]], position: int, in_store: int) -> SharedPrefixKVCache:
    """Attention layer ``position``'s live cache over the stored pieces (_shared_groups), read in place."""
    return SharedPrefixKVCache(
        [_joined([s.keys[position] for s in group]) for group in groups],
        [_joined([s.values[position] for s in group]) for group in groups],
        in_store,
    )


def _joined(pieces: list[mx.array]) -> mx.array:
    """One stored array as it is (read in place), or a copy joining several short ones."""
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def _join_in_groups(parts: list[list[mx.array]]) -> list[list[mx.array]]:
    """Each layer's segments joined FORK_GROUP at a time, one evaluation per group, until at most FORK_GROUP are left.

    Why: MLX's CUDA backend caches an evaluation's CUDA graphs by topology,
    and the fork's concatenation of S segments (per layer) is a topology per
    S. A chat's stored path gains segments every turn (a message's end, the
    answer), so without this nearly every turn forked at a segment count not
    met before and paid for new graphs (bench/probes/chat_turn_probe.py). In groups,
    every evaluation joins 1 to FORK_GROUP segments per layer, and the last
    join (fork_cache, with the headroom) takes at most FORK_GROUP pieces:
    shapes the warm-up builds at load (warm_up.py forks up to 2 x FORK_GROUP
    segments). The price is one more copy of the prefix, in device memory.
    """
    while len(parts[0]) > FORK_GROUP:  # every layer has one part per segment
        joined: list[list[mx.array]] = [[] for _ in parts]
        for start in range(0, len(parts[0]), FORK_GROUP):
            group = [mx.concatenate(layer_parts[start : start + FORK_GROUP], axis=2) for layer_parts in parts]
            mx.eval(group)
            for layer_joined, piece in zip(joined, group):
                layer_joined.append(piece)
        parts = joined
    return parts


def start_fork_copy(cache: list[Any]) -> None:
    """Queue a fork's copy on its own (as evaluate_fork does) without waiting for it.

    For an exact repeat whose first token came from stored logits: the copy
    runs on the device while that token goes out, and the first decode step
    finds it done or nearly so.
    """
    mx.async_eval([c.state for c in cache])


def evaluate_fork(cache: list[Any]) -> None:
    """Run a fork's copy now, on its own, rather than lazily with the first forward pass.

    Why: on CUDA, MLX replays the kernels of one evaluation as CUDA graphs,
    cut into windows of a fixed number of nodes and cached by each window's
    topology (mlx/backend/cuda/device.cpp: ``graph_key_``). A lazy fork puts
    its concatenations (one per stored segment and layer) in front of the
    forward pass, so every new segment count shifts the windows of the whole
    forward, and each shifted window is a graph built anew: the first exact
    hit at each new segment count costs more than its repeats
    (bench/probes/first_hit_probe.py; docs/decisions.md). Evaluated alone, the
    fork's graphs depend on the segment count only (warm_up.py builds the
    common ones at load), and the forward's on the pass alone. On a CPU it
    only moves the same copy a little earlier.
    """
    mx.eval([c.state for c in cache])


def _fork_window(
    window_size: int, segments: list[KVSegment], position: int, length: int, quant: KvQuantization | None
) -> Any:
    """A sliding-window layer at ``length``: the last min(length, window) stored positions, in order.

    Only the tail segments are read; the concatenation is a new array, so the
    fork never aliases the store. Under --kv-bits the packed parts are
    rebuilt the same way and attention gets their dequantization.
    """
    needed = min(length, window_size)
    keys, values = [], []
    for segment in reversed(segments):
        if needed == 0:
            break
        take = min(needed, segment.num_tokens)
        keys.append(_tail(segment.keys[position], take))
        values.append(_tail(segment.values[position], take))
        needed -= take
    keys.reverse()
    values.reverse()
    if quant is None:
        return window_cache(window_size, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2), length)
    packed_keys = tuple(mx.concatenate([k[part] for k in keys], axis=2) for part in range(NUM_PACKED_PARTS))
    packed_values = tuple(mx.concatenate([v[part] for v in values], axis=2) for part in range(NUM_PACKED_PARTS))
    cache = RoundTripWindowKVCache(window_size, quant)
    fill_window(cache, quant.dequantize(packed_keys), quant.dequantize(packed_values), length)
    for part, part_keys, part_values in zip(cache.packed, packed_keys, packed_values):
        fill_window(part, part_keys, part_values, length)
    return cache


def _tail(layer: Any, num_tokens: int) -> Any:
    """The last ``num_tokens`` positions of a stored layer: an array, or each array of a packed one."""
    if isinstance(layer, tuple):
        return tuple(array[..., array.shape[2] - num_tokens :, :] for array in layer)
    return layer[..., layer.shape[2] - num_tokens :, :]
