"""The matmul form of attention for short tails equals MLX's fused one, and the router sends only short passes to it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from prefixd.daemon.models import tail_attention
from prefixd.daemon.models.tail_attention import matmul_attention, resolve_mode, routed_attention


def _qkv(batch=1, heads=8, kv_heads=2, queries=7, keys=40, dim=16, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, heads, queries, dim))
    k = mx.random.normal((batch, kv_heads, keys, dim))
    v = mx.random.normal((batch, kv_heads, keys, dim))
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_causal_tail_on_a_longer_cache_matches_the_fused_kernel(heads, kv_heads):
    q, k, v = _qkv(heads=heads, kv_heads=kv_heads)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    assert mx.allclose(matmul_attention(q, k, v, 0.25, "causal"), fused, atol=1e-5).item()


def test_boolean_and_additive_masks_with_a_batch_match_the_fused_kernel():
    q, k, v = _qkv(batch=3, heads=8, kv_heads=4, queries=5, keys=12)
    # left padding as mlx-lm's batch makes it: row b ignores its first b keys
    allowed = mx.arange(12)[None, None, None, :] >= mx.arange(3)[:, None, None, None]
    allowed = allowed & (mx.arange(7, 12)[None, None, :, None] >= mx.arange(12)[None, None, None, :])
    for mask in (allowed, mx.where(allowed, 0.0, -1e9).astype(mx.float32)):
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
        assert mx.allclose(matmul_attention(q, k, v, 0.5, mask), fused, atol=1e-5).item()


def test_no_mask_matches_the_fused_kernel():
    q, k, v = _qkv(queries=3, keys=3)
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=None)
    assert mx.allclose(matmul_attention(q, k, v, 0.3, None), fused, atol=1e-5).item()


class _QuantizedCache:
    bits, group_size = 8, 64


def test_router_takes_the_matmul_form_only_for_short_multi_token_passes(monkeypatch):
    monkeypatch.setitem(tail_attention._state, "mode", "matmul")
    calls = []
    monkeypatch.setattr(tail_attention, "matmul_attention", lambda *a: calls.append(a[0].shape) or a[0])
    q, k, v = _qkv(queries=7, keys=40)
    routed_attention(q, k, v, None, 0.25, "causal")
    assert calls == [q.shape]

    one_token = q[:, :, :1]
    routed_attention(one_token, k, v, None, 0.25, None)  # a decode step keeps the vector kernel
    monkeypatch.setattr(tail_attention, "MAX_MATMUL_SCORES", 8 * 7 * 39)
    routed_attention(q, k, v, None, 0.25, "causal")  # too many scores: fused
    assert len(calls) == 1

    monkeypatch.setattr(tail_attention, "MAX_MATMUL_SCORES", 1 << 26)
    with pytest.raises(
        Exception
    ):  # a quantized cache goes to mlx-lm's own quantized path (these keys are not quantized)
        routed_attention(q, k, v, _QuantizedCache(), 0.25, "causal")
    assert len(calls) == 1


def test_fused_mode_never_takes_the_matmul_form(monkeypatch):
    monkeypatch.setitem(tail_attention._state, "mode", "fused")
    monkeypatch.setattr(tail_attention, "matmul_attention", lambda *a: pytest.fail("matmul form used"))
    q, k, v = _qkv()
    out = routed_attention(q, k, v, None, 0.25, "causal")
    assert out.shape == q.shape


def test_modes():
    assert resolve_mode("fused") == "fused" and resolve_mode("matmul") == "matmul"
    assert resolve_mode("kernel") == "kernel"
    assert resolve_mode("auto") == (
        "kernel" if mx.default_device().type == mx.gpu and not mx.metal.is_available() else "fused"
    )
    with pytest.raises(ValueError, match="auto, fused, matmul, kernel"):
        resolve_mode("flash")


def _padded_batch_cache(lengths: list[int], kv_heads=2, dim=64):
    """mlx-lm's batch cache holding rows of these lengths, left-padded to the longest (as a decode batch is)."""
    from mlx_lm.models.cache import BatchKVCache

    longest = max(lengths)
    cache = BatchKVCache([longest - n for n in lengths])
    mx.random.seed(5)
    cache.update_and_fetch(
        mx.random.normal((len(lengths), kv_heads, longest, dim)),
        mx.random.normal((len(lengths), kv_heads, longest, dim)),
    )
    return cache


def test_kernel_mode_sends_a_padded_decode_step_and_nothing_else_to_the_kernel(monkeypatch):
    from prefixd.daemon.models import padded_decode_attention

    monkeypatch.setitem(tail_attention._state, "mode", "kernel")
    monkeypatch.setattr(padded_decode_attention, "_checked", {(64, 4, mx.float32)})  # as agrees() leaves it
    calls = []
    monkeypatch.setattr(
        padded_decode_attention, "attention", lambda q, k, v, pads, scale: calls.append(pads.tolist()) or q
    )
    cache = _padded_batch_cache([5, 9, 2])
    keys, values = cache.keys_and_values()
    step = mx.random.normal((3, 8, 1, 64))
    mask = (mx.arange(keys.shape[2])[None] >= cache.left_padding[:, None])[:, None, None, :]
    routed_attention(step, keys, values, cache, 0.125, mask)
    assert calls == [[4, 0, 7]]  # each row's padding, from the cache

    routed_attention(
        mx.random.normal((3, 8, 2, 64)), keys, values, cache, 0.125, None
    )  # two queries: not a decode step
    routed_attention(step[:1], keys[:1], values[:1], None, 0.125, None)  # a solo cache: MLX's vector kernel
    routed_attention(step, keys, values, cache, 0.125, mask, sinks=mx.zeros((8,)))  # sinks: MLX's
    routed_attention(
        mx.random.normal((3, 8, 1, 32)), keys[..., :32], values[..., :32], cache, 0.125, None
    )  # head size 32
    routed_attention(step.astype(mx.bfloat16), keys, values, cache, 0.125, mask)  # a variant not checked at load
    monkeypatch.setitem(tail_attention._state, "mode", "matmul")
    routed_attention(step, keys, values, cache, 0.125, mask)
    assert len(calls) == 1


def test_the_kernels_reference_is_each_rows_attention_over_its_own_keys():
    """What the kernel is checked against at install: MLX's attention with each row's padding masked out."""
    from prefixd.daemon.models import padded_decode_attention

    cache = _padded_batch_cache([5, 9, 2])
    keys, values = cache.keys_and_values()
    q = mx.random.normal((3, 8, 1, 64))
    got = padded_decode_attention.reference(q, keys, values, cache.left_padding, 0.125)
    for row, pad in enumerate(cache.left_padding.tolist()):
        alone = mx.fast.scaled_dot_product_attention(
            q[row : row + 1], keys[row : row + 1, :, pad:], values[row : row + 1, :, pad:], scale=0.125
        )
        assert mx.allclose(got[row : row + 1], alone, atol=1e-5).item()


def test_the_kernel_is_checked_at_load_for_the_models_own_attention_shapes():
    """Each shape is built and checked at load (none is built in a live step); shapes it is not written for are skipped."""
    from prefixd.daemon.models import padded_decode_attention

    assert padded_decode_attention.variant(16, 8, 128) and padded_decode_attention.variant(9, 3, 64)
    assert not padded_decode_attention.variant(16, 8, 96)  # head size
    assert not padded_decode_attention.variant(32, 2, 128)  # 16 query heads a key-value head
    ok, why = padded_decode_attention.agrees([(16, 8, 96)])
    assert not ok and "written for" in why


def test_long_rows_split_into_key_ranges_that_fill_the_gpu_and_change_rarely():
    """Split-K: a range per block, at least MIN_KEYS_PER_SPLIT keys each, a power of two; short rows take one kernel."""
    from prefixd.daemon.models import padded_decode_attention as pda

    assert pda.splits_for(1000, rows=8, kv_heads=8) == 4  # 64 blocks want 16 ranges; 1,000 keys hold 7 -> 4
    assert pda.splits_for(200, rows=1, kv_heads=8) == 1  # fewer keys than two ranges: the single kernel
    assert pda.splits_for(8000, rows=4, kv_heads=8) == 32  # 32 blocks want 32 ranges; 8,000 keys hold 62
    assert pda.splits_for(32000, rows=1, kv_heads=8) == pda.MAX_SPLITS
    assert pda.splits_for(32000, rows=128, kv_heads=8) == 1  # the rows alone fill the GPU
    for length in range(1, 40000, 997):
        for rows in (1, 3, 4, 8):
            n = pda.splits_for(length, rows, 8)
            assert n & (n - 1) == 0 and 1 <= n <= pda.MAX_SPLITS
            assert n == 1 or length // n >= pda.MIN_KEYS_PER_SPLIT
    # Thresholds, not every step: a row growing one token at a time changes its range count a few times only.
    counts = {pda.splits_for(length, 1, 8) for length in range(100, 33000)}
    assert counts == {1, 2, 4, 8, 16, 32, 64}


def test_a_sequence_decoding_alone_keeps_mlx_unless_told_a_depth(monkeypatch):
    """The solo path's own cache (no padding, no mask): MLX's vector kernel (measured faster), or, where
    SOLO_MIN_KEYS is set (the probe does), the kernel from that many keys on."""
    from mlx_lm.models.cache import KVCache

    from prefixd.daemon.models import padded_decode_attention

    monkeypatch.setitem(tail_attention._state, "mode", "kernel")
    monkeypatch.setattr(padded_decode_attention, "_checked", {(64, 4, mx.float32)})
    calls = []
    monkeypatch.setattr(
        padded_decode_attention, "attention", lambda q, k, v, starts, scale: calls.append(starts.tolist()) or q
    )
    cache = KVCache()
    step = mx.random.normal((1, 8, 1, 64))
    monkeypatch.setattr(padded_decode_attention, "SOLO_MIN_KEYS", None)
    routed_attention(step, mx.zeros((1, 2, 99, 64)), mx.zeros((1, 2, 99, 64)), cache, 0.125, None)
    assert calls == []  # the daemon's setting: never
    monkeypatch.setattr(padded_decode_attention, "SOLO_MIN_KEYS", 16)
    for length in (15, 16):
        keys, values = mx.random.normal((1, 2, length, 64)), mx.random.normal((1, 2, length, 64))
        routed_attention(step, keys, values, cache, 0.125, None)
    assert calls == [[0]]  # 16 keys: the kernel, the whole row; 15: MLX's
    routed_attention(step, keys, values, cache, 0.125, mx.ones((1, 16), dtype=mx.bool_))  # a mask: MLX's
    routed_attention(mx.random.normal((1, 8, 2, 64)), keys, values, cache, 0.125, None)  # two queries: not a step
    assert len(calls) == 1


def test_a_changed_kernel_source_gets_a_new_name_so_no_stale_compiled_kernel_is_loaded(monkeypatch):
    """MLX caches compiled custom kernels on disk by name and template arguments only."""
    from prefixd.daemon.models import padded_decode_attention as pda

    names = []
    monkeypatch.setattr(pda, "_kernels", {})
    monkeypatch.setattr(pda.mx.fast, "cuda_kernel", lambda **kwargs: names.append(kwargs["name"]) or object())
    pda._built("k", "out[0] = 1;", ["a"], ["out"])
    pda._built("k", "out[0] = 1;", ["a"], ["out"])  # made once per process
    monkeypatch.setattr(pda, "_kernels", {})
    pda._built("k", "out[0] = 2;", ["a"], ["out"])
    assert len(names) == 2 and names[0] != names[1] and all(n.startswith("k_") for n in names)
