"""A fork without a copy (kv/shared_prefix_cache.py, models/prefix_attention.py), without a model.

The stored pieces are read in place and never written; attention over
pieces plus the sequence's own keys is the attention over the joined
sequence; in mlx-lm's decode batch each row still reads its pieces in
place and attends as it would alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from prefixd.daemon.kv.fork import LONG_SHARED_PIECE_TOKENS, MAX_SHARED_PIECES, SHARED_PIECE_MIN_TOKENS, _shared_groups
from prefixd.daemon.kv.segments import KVSegment
from prefixd.daemon.kv.shared_prefix_cache import (
    SharedPrefixBatchKVCache,
    SharedPrefixKVCache,
    batch_rows,
    materialized,
    tokens_read_in_store,
)
from prefixd.daemon.models.prefix_attention import batch_prefix_attention, prefix_attention

KV_HEADS, HEAD_DIM = 2, 16


def random_kv(num_tokens: int, seed: int) -> mx.array:
    return mx.random.normal((1, KV_HEADS, num_tokens, HEAD_DIM), key=mx.random.key(seed))


def pieces(sizes: list[int], seed: int = 0) -> tuple[list[mx.array], list[mx.array]]:
    keys = [random_kv(n, seed + 2 * i) for i, n in enumerate(sizes)]
    values = [random_kv(n, seed + 2 * i + 1) for i, n in enumerate(sizes)]
    mx.eval(keys, values)
    return keys, values


def reference(queries, keys, values, mask):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=HEAD_DIM**-0.5, mask=mask)


@pytest.mark.parametrize("num_heads", [KV_HEADS, 3 * KV_HEADS])
@pytest.mark.parametrize("num_queries,mask_kind", [(1, None), (5, "causal"), (5, "array")])
def test_attention_over_pieces_is_attention_over_the_joined_sequence(num_heads, num_queries, mask_kind):
    prefix_keys, prefix_values = pieces([7, 12, 3])
    own_keys, own_values = random_kv(9, 50), random_kv(9, 51)
    queries = mx.random.normal((1, num_heads, num_queries, HEAD_DIM), key=mx.random.key(60))
    joined_keys = mx.concatenate([*prefix_keys, own_keys], axis=2)
    joined_values = mx.concatenate([*prefix_values, own_values], axis=2)
    total = joined_keys.shape[2]
    mask = mask_kind
    if mask_kind == "array":  # causal, and position 4 hidden from everyone: a mask that reaches into the pieces
        rows = mx.arange(total - num_queries, total)[:, None]
        mask = (rows >= mx.arange(total)[None]) & (mx.arange(total)[None] != 4)
    expected = reference(queries, joined_keys, joined_values, mask)
    got = prefix_attention(queries, prefix_keys, prefix_values, own_keys, own_values, HEAD_DIM**-0.5, mask)
    assert got.shape == expected.shape
    assert np.allclose(np.array(got), np.array(expected), atol=1e-5)


def test_a_shared_cache_writes_only_its_own_buffer_and_reads_every_position():
    prefix_keys, prefix_values = pieces([10, 20])
    before = [np.array(a) for a in prefix_keys + prefix_values]
    cache = SharedPrefixKVCache(prefix_keys, prefix_values)
    assert (cache.offset, cache.prefix_len, cache.own_len, cache.nbytes) == (30, 30, 0, 0)
    new_keys, new_values = random_kv(5, 90), random_kv(5, 91)
    own_keys, own_values = cache.update_and_fetch(new_keys, new_values)
    assert own_keys.shape[2] == 5 and cache.offset == 35
    cache.update_and_fetch(random_kv(300, 92), random_kv(300, 93))  # grows past one step
    assert cache.offset == 335 and cache.own_len == 305
    joined = np.array(mx.concatenate([*prefix_keys, new_keys], axis=2))
    keys, _ = cache.positions(8, 33)  # across both pieces and into the own buffer
    assert np.array_equal(np.array(keys), joined[..., 8:33, :])
    for stored, original in zip(cache.prefix_keys + cache.prefix_values, before):
        assert np.array_equal(np.array(stored), original)  # the store's arrays are untouched


def test_trimming_into_the_pieces_keeps_views_and_the_cache_goes_on():
    prefix_keys, prefix_values = pieces([10, 20])
    joined = np.array(mx.concatenate(prefix_keys, axis=2))
    cache = SharedPrefixKVCache(prefix_keys, prefix_values)
    cache.update_and_fetch(random_kv(4, 7), random_kv(4, 8))
    assert cache.trim(2) == 2 and cache.offset == 32 and cache.prefix_len == 30
    assert cache.trim(17) == 17  # the own 2, then 15 of the pieces
    assert (cache.offset, cache.prefix_len, cache.own_len) == (15, 15, 0)
    assert np.array_equal(np.array(cache.positions(0, 15)[0]), joined[..., :15, :])
    cache.update_and_fetch(random_kv(3, 9), random_kv(3, 10))
    assert cache.offset == 18
    assert np.array_equal(np.array(prefix_keys[1]), joined[..., 10:30, :])  # the stored piece itself is whole


def shared_row(piece_keys, piece_values, own_tokens: int, seed: int) -> SharedPrefixKVCache:
    cache = SharedPrefixKVCache(piece_keys, piece_values)
    if own_tokens:
        cache.update_and_fetch(random_kv(own_tokens, seed), random_kv(own_tokens, seed + 1))
    return cache


def test_a_decode_batch_reads_each_rows_pieces_in_place_and_attends_as_each_row_alone():
    system_keys, system_values = pieces([12, 9], seed=100)  # one stored system prompt, two rows on it
    other_keys, other_values = pieces([15], seed=200)
    cold = KVCache()
    cold.update_and_fetch(random_kv(6, 300), random_kv(6, 301))
    rows = [
        shared_row(system_keys, system_values, 3, 10),
        shared_row(other_keys, other_values, 5, 20),
        shared_row(system_keys, system_values, 0, 30),
        cold,
    ]
    stored_before = [np.array(a) for a in system_keys + system_values + other_keys + other_values]
    prepared = [batch_rows([row], shares_forks=True)[0] for row in rows]
    assert prepared[0] is rows[0] and isinstance(prepared[3], SharedPrefixKVCache)  # the cold row adopted, not copied
    expected_before = [row.positions(0, row.offset) for row in prepared]
    batch = SharedPrefixKVCache.merge(prepared)
    assert isinstance(batch, SharedPrefixBatchKVCache) and batch.has_pieces
    assert batch.offset.tolist() == [24, 20, 21, 6]  # absolute positions, for rotary embeddings
    assert batch.keys.shape[2] == 6  # the padded buffer holds the own positions only
    new_keys, new_values = random_kv(4, 400).reshape(4, KV_HEADS, 1, HEAD_DIM), random_kv(4, 401).reshape(4, KV_HEADS, 1, HEAD_DIM)
    mask = batch.make_mask(1)
    own_keys, own_values = batch.update_and_fetch(new_keys, new_values)
    queries = mx.random.normal((4, 3 * KV_HEADS, 1, HEAD_DIM), key=mx.random.key(500))
    got = batch_prefix_attention(queries, batch.row_keys, batch.row_values, own_keys, own_values, HEAD_DIM**-0.5, mask)
    for i, (keys, values) in enumerate(expected_before):
        row_keys = mx.concatenate([keys, new_keys[i : i + 1]], axis=2)
        row_values = mx.concatenate([values, new_values[i : i + 1]], axis=2)
        alone = reference(queries[i : i + 1], row_keys, row_values, None)
        assert np.allclose(np.array(got[i : i + 1]), np.array(alone), atol=1e-5), i
    # a row leaving keeps its pieces, its own positions and the new one
    left = batch.extract(1)
    assert isinstance(left, SharedPrefixKVCache) and left.prefix_keys == other_keys and left.offset == 21
    assert np.array_equal(np.array(left.positions(20, 21)[0]), np.array(new_keys[1:2]))
    batch.filter([0, 2, 3])
    assert batch.row_keys == [system_keys, system_keys, []] and batch.offset.tolist() == [25, 22, 7]
    batch.extend(SharedPrefixKVCache.merge([shared_row(other_keys, other_values, 2, 40)]))
    assert batch.row_keys[-1] == other_keys and batch.offset.tolist() == [25, 22, 7, 17]
    for stored, original in zip(system_keys + system_values + other_keys + other_values, stored_before):
        assert np.array_equal(np.array(stored), original)


def test_a_batch_takes_shared_rows_only_and_a_copying_model_copies():
    with pytest.raises(TypeError):
        SharedPrefixBatchKVCache.of([KVCache()])
    prefix_keys, prefix_values = pieces([6, 6])
    shared = shared_row(prefix_keys, prefix_values, 2, 20)
    plain = batch_rows([shared], shares_forks=False)[0]
    assert isinstance(plain, KVCache) and not isinstance(plain, SharedPrefixKVCache) and plain.offset == 14
    assert np.array_equal(np.array(plain.keys[..., :14, :]), np.array(shared.positions(0, 14)[0]))
    assert isinstance(materialized(shared), KVCache)


def segment(num_tokens: int) -> KVSegment:
    return KVSegment([mx.zeros((1, 1, num_tokens, 1))], [mx.zeros((1, 1, num_tokens, 1))], num_tokens)


def test_a_shared_cache_says_how_much_of_it_the_store_holds():
    prefix_keys, prefix_values = pieces([10, 20])
    assert tokens_read_in_store([KVCache(), SharedPrefixKVCache(prefix_keys, prefix_values)]) == 30
    joined = SharedPrefixKVCache(prefix_keys, prefix_values, in_store=10)  # the second piece a joined copy
    assert tokens_read_in_store([joined]) == 10
    joined.trim(25)
    assert joined.in_store == 5
    assert tokens_read_in_store([KVCache()]) == 0


def test_a_fork_reads_long_segments_in_place_and_joins_runs_of_short_ones():
    small = SHARED_PIECE_MIN_TOKENS // 8
    sizes = [512, 512, small, small, 512, small]
    groups = _shared_groups([segment(n) for n in sizes])
    assert [[s.num_tokens for s in group] for group in groups] == [[512], [512], [small, small], [512], [small]]
    # a long chat: many short turns become few pieces
    assert len(_shared_groups([segment(small)] * 40)) == 5
    # beyond MAX_SHARED_PIECES pieces the fork copies, as without sharing, unless they are long
    assert _shared_groups([segment(300)] * (MAX_SHARED_PIECES + 1)) is None
    assert len(_shared_groups([segment(LONG_SHARED_PIECE_TOKENS)] * 40)) == 40  # a 20k-token prompt in chunks
    assert _shared_groups([segment(LONG_SHARED_PIECE_TOKENS)] * 40 + [segment(300)] * 20) is None
