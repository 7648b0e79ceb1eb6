"""Which layers of a model's mlx-lm cache the prefix store can hold, and how.

Attention layers (``KVCache``) are trimmable: any prefix of a stored sequence
is valid. State layers (``ArraysCache``: the conv/SSM state of hybrid models)
are not: such a model can only resume where a snapshot of them was taken.
Anything else (rotating, quantized, chunked caches) is not stored at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache


@dataclass(frozen=True)
class CacheLayout:
    """Which layers of a model's cache are attention (trimmable) and which are state."""

    attention_layers: tuple[int, ...]
    state_layers: tuple[int, ...]
    other_layers: tuple[int, ...]

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_layers)

    @property
    def is_supported(self) -> bool:
        """Only KVCache and ArraysCache layers can be stored and forked exactly."""
        return not self.other_layers

    def describe(self) -> dict[str, int]:
        return {
            "kvcache": len(self.attention_layers),
            "arrays": len(self.state_layers),
            "other": len(self.other_layers),
        }


def make_cache_layout(model: Any) -> CacheLayout:
    """Classify the layers of the cache that mlx-lm makes for ``model``."""
    attention, state, other = [], [], []
    for index, layer_cache in enumerate(make_prompt_cache(model)):
        # Exact type checks: subclasses (rotating, quantized, chunked) do not
        # share KVCache's "any prefix is valid" property.
        if type(layer_cache) is KVCache:
            attention.append(index)
        elif isinstance(layer_cache, ArraysCache):
            state.append(index)
        else:
            other.append(index)
    return CacheLayout(tuple(attention), tuple(state), tuple(other))


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
