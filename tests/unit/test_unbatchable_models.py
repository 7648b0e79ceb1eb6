"""A model whose cache mlx-lm cannot batch is refused when it loads, with a message naming the cache classes."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from prefixd.daemon.kv.layout import unbatchable_cache_types
from prefixd.daemon.models.loaded_model import UnsupportedModelError, refuse_unbatchable


def test_batchable_caches_pass():
    assert unbatchable_cache_types([KVCache(), ArraysCache(2), RotatingKVCache(max_size=64)]) == []
    assert unbatchable_cache_types([CacheList(KVCache(), ArraysCache(1))]) == []


def test_caches_without_merge_are_named_once():
    caches = [KVCache(), ChunkedKVCache(16), QuantizedKVCache(), ChunkedKVCache(16), CacheList(KVCache(), ChunkedKVCache(8))]
    assert unbatchable_cache_types(caches) == ["ChunkedKVCache", "QuantizedKVCache"]


class _ChunkedModel:
    """What llama4 looks like to the engine: chunked attention caches."""

    layers = [object(), object()]

    def make_cache(self):
        return [KVCache(), ChunkedKVCache(8192)]


def test_a_model_with_a_chunked_cache_is_refused_at_load():
    with pytest.raises(UnsupportedModelError, match=r"llama4-like: its cache layers \(ChunkedKVCache\) cannot be batched"):
        refuse_unbatchable(_ChunkedModel(), Path("/models/llama4-like"))
