"""The engine's quick calls (pin, stats, models), run on the engine thread between steps.

The front reaches them through ``engine.call(engine.controls.<name>)``: each
reads or changes engine state that only the engine thread may touch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ...protocol.errors import ErrorCode, RpcError
from ..cache import NotStored, PinBudgetExceeded

if TYPE_CHECKING:
    from .engine import Engine


class ControlCalls:
    def __init__(self, engine: "Engine"):
        self.engine = engine

    def pin_tokens(self, model: str, tokens: list[int], pinned: bool) -> dict[str, Any]:
        """Pin (or unpin) a prompt's stored prefix: the store keeps a prompt's first len-1 tokens."""
        fingerprint = self.engine.entry_for(model).fingerprint  # the store keeps a model's entries loaded or not
        tokens = tokens[:-1] if len(tokens) > 1 else tokens  # the last token always runs
        store = self.engine.store
        try:
            result = store.pin(fingerprint, tokens) if pinned else store.unpin(fingerprint, tokens)
        except NotStored as exc:
            hint = "send it with cache.warm first" if pinned else "it is not pinned"
            raise RpcError(ErrorCode.NOT_CACHED, f"{exc}; {hint}") from None
        except PinBudgetExceeded as exc:
            raise RpcError(ErrorCode.PIN_BUDGET_EXCEEDED, str(exc)) from None
        return {"pinned_tokens": result.pinned_tokens, "pinned_bytes": result.pinned_bytes}

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        store_stats = engine.store.stats()
        names = {entry.fingerprint: name for name, entry in engine.catalog.items()}
        return {
            "requests": {**engine.scheduler.counters, **engine.scheduler.counts(), **engine.inbox.counts()},
            "cache": {
                "total": _plain(store_stats.total),
                "per_model": {names.get(ns, ns): _plain(s) for ns, s in store_stats.namespaces.items()},
            },
            "models": {
                name: {
                    "prefill_tokens_per_s": round(m.prefill_tokens_per_s, 1),
                    "weight_bytes": m.weight_bytes,
                    "kv": m.kv,
                }
                for name, m in engine.models.items()
            },  # the loaded ones
            "residency": {
                "resident_bytes": engine.residency.resident_bytes,
                "max_model_bytes": engine.residency.max_bytes,
                "waiting_for_room": engine.residency.num_parked,
            },
            "shadow": engine.scheduler.shadow.stats(),
            "process": {
                "peak_rss_bytes": peak_rss_bytes(),
                # What MLX holds now: the weights, the prefix store, the running sequences' KV, temporaries.
                "mlx_active_bytes": mx.get_active_memory(),
                "mlx_cache_bytes": mx.get_cache_memory(),  # freed, kept for reuse (bounded: --mlx-cache-bytes)
                "mlx_peak_bytes": mx.get_peak_memory(),
            },
        }

    def load_model(self, name: str, keep_alive: float | None) -> dict[str, Any]:
        """Load a model now (Ollama's load request), unless it is loaded; ``keep_alive`` as a request's."""
        self.engine.residency.ensure_loaded(name, keep_alive)
        return self.engine.residency.describe(name)

    def unload_model(self, name: str) -> dict[str, Any]:
        """Unload a model now, or as soon as the requests using it end; its prefix-store entries stay."""
        self.engine.residency.unload(name)
        return self.engine.residency.describe(name)

    def describe_models(self) -> list[dict[str, Any]]:
        """Every configured model, loaded or not, with its residency (memory, since when, until when)."""
        engine = self.engine
        engine.residency.unload_expired()  # an expired model is listed as unloaded, not as due
        described = []
        for name, entry in engine.catalog.items():
            loaded = engine.models.get(name)
            default = name == engine.default_model
            base = loaded.describe(default) if loaded is not None else entry.describe(default)
            described.append({**base, **engine.residency.describe(name)})
        return described


def peak_rss_bytes() -> int | None:
    """The daemon process's peak resident memory so far (None where the OS does not say)."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _plain(value: Any) -> Any:
    """NamedTuples and dataclasses as plain maps, for msgpack."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if hasattr(value, "__dataclass_fields__"):
        return {k: _plain(getattr(value, k)) for k in value.__dataclass_fields__}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
