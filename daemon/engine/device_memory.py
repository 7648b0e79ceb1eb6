"""How much freed device memory MLX may keep for reuse (its buffer cache).

MLX keeps the buffers a computation frees, to hand them out again without a
new allocation; by default it keeps up to its whole memory limit, that is
nearly the whole device. A daemon's shapes keep changing (every turn of a chat
forks and extends a longer cache), so most kept buffers never fit a later
request, and the cache grows until the device is full and a decode step fails
with out of memory (a few agents do it in seconds on a GPU: docs/decisions.md).
The engine sets a bound at start (engine thread: MLX
state is per thread's stream, the limit is process-wide).
"""

from __future__ import annotations

import structlog

log = structlog.get_logger("prefixd.engine")
MIN_CACHE_BYTES = 256 << 20


def default_cache_limit(kv_budget_bytes: int) -> int:
    """A quarter of the KV budget, at least 256 MiB: room for a step's temporaries, not for every past shape."""
    return max(MIN_CACHE_BYTES, kv_budget_bytes // 4)


def configure_buffer_cache(limit_bytes: int | None, kv_budget_bytes: int) -> None:
    """The limit given, else on a GPU the default bound; on a CPU MLX's own (no growth measured there)."""
    import mlx.core as mx

    if limit_bytes is None and mx.default_device().type != mx.gpu:
        return
    limit_buffer_cache(default_cache_limit(kv_budget_bytes) if limit_bytes is None else limit_bytes)


def limit_buffer_cache(limit_bytes: int) -> None:
    """Bound MLX's buffer cache (process-wide); logged with MLX's memory limit for reference."""
    import mlx.core as mx

    previous = mx.set_cache_limit(limit_bytes)
    log.info(
        "mlx_buffer_cache_limited",
        cache_limit_bytes=limit_bytes,
        previous_limit_bytes=previous,
        memory_limit_bytes=_memory_limit(mx),
    )


def _memory_limit(mx) -> int | None:
    try:
        current = mx.set_memory_limit(0)  # returns the limit it replaces; put it straight back
        mx.set_memory_limit(current)
        return current
    except (AttributeError, RuntimeError, ValueError):
        return None
