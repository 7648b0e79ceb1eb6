"""Which layers of a model's mlx-lm cache the prefix store can hold, and how.

Attention layers keep per-token keys and values, and the store keeps them for
every token, so any prefix of a stored sequence is valid. They are either
``KVCache`` (global attention) or ``RotatingKVCache`` (a sliding window: the
live cache holds only the last ``window_size`` positions, but the store holds
all of them, so a fork at any depth can rebuild the window there; see
window_kv.py). State layers (``ArraysCache``: the conv/SSM state of hybrid
models) are not trimmable: such a model can only resume where a snapshot of
them was taken. Anything else (quantized, chunked caches; a rotating cache
with ``keep`` tokens) is not stored at all. ``kv_bits`` (--kv-bits) says
whether the attention layers' KV is quantized, in the store and in every
live pass (quantized_kv.py, round_trip_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from .quantized_kv import KvQuantization


@dataclass(frozen=True)
class CacheLayout:
    """Which layers of a model's cache are attention (per-token KV) and which are state."""

    attention_layers: tuple[int, ...]  # KVCache and RotatingKVCache layers, in layer order
    state_layers: tuple[int, ...]
    other_layers: tuple[int, ...]
    window_layers: tuple[int, ...] = ()  # the RotatingKVCache ones among attention_layers
    window_size: int = 0  # their max_size (one size for all of them)
    kv_bits: int = 0  # 8 or 4: attention KV quantized (--kv-bits); 0: full precision
    shares_forks: bool = (
        False  # a hit's global layers read the stored segments in place (--fork, shared_prefix_cache.py)
    )

    @property
    def quantization(self) -> KvQuantization | None:
        return KvQuantization(self.kv_bits) if self.kv_bits else None

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_layers)

    @property
    def is_supported(self) -> bool:
        """Only these layer kinds can be stored and forked exactly."""
        return not self.other_layers

    def describe(self) -> dict[str, int]:
        return {
            "kvcache": len(self.attention_layers) - len(self.window_layers),
            "rotating": len(self.window_layers),
            "arrays": len(self.state_layers),
            "other": len(self.other_layers),
        }


def make_cache_layout(model: Any, kv_bits: int = 0) -> CacheLayout:
    """Classify the layers of the cache that mlx-lm makes for ``model``.

    ``kv_bits`` applies to attention layers: a model without any keeps 0.
    """
    attention, window, state, other = [], [], [], []
    window_sizes = set()
    for index, layer_cache in enumerate(make_prompt_cache(model)):
        # Exact type checks: subclasses (quantized, chunked) do not share
        # these classes' "the KV of any prefix rebuilds the cache" property.
        if type(layer_cache) is KVCache:
            attention.append(index)
        elif type(layer_cache) is RotatingKVCache and layer_cache.keep == 0:
            # keep > 0 pins the first tokens in the window (attention sinks): a
            # rebuilt window would need them too; no model prefixd serves does that.
            attention.append(index)
            window.append(index)
            window_sizes.add(layer_cache.max_size)
        elif isinstance(layer_cache, ArraysCache):
            state.append(index)
        else:
            other.append(index)
    if len(window_sizes) > 1:  # never seen; one size keeps the fork and its tests simple
        other, attention, window = sorted(other + window), [i for i in attention if i not in window], []
        window_sizes = set()
    return CacheLayout(
        tuple(attention),
        tuple(state),
        tuple(other),
        tuple(window),
        max(window_sizes, default=0),
        kv_bits if attention else 0,
    )


def unbatchable_cache_types(caches: list[Any]) -> list[str]:
    """Names of the cache classes among ``caches`` that mlx-lm's batch cannot merge (sorted, unique).

    BatchGenerator merges each layer's caches with the class's ``merge``; a
    class without one (quantized, chunked, concatenating caches) fails there,
    which would otherwise show only once two requests decode together.
    A CacheList merges when every cache it holds does.
    """
    names = set()
    for layer_cache in caches:
        if hasattr(layer_cache, "caches") and callable(getattr(type(layer_cache), "merge", None)):
            names.update(unbatchable_cache_types(list(layer_cache.caches)))
        elif not callable(getattr(type(layer_cache), "merge", None)):
            names.add(type(layer_cache).__name__)
    return sorted(names)
