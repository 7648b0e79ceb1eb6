"""What the engine is told at start. The defaults live in one place: service/config.py's table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSettings:
    model_specs: tuple[str, ...]
    dtype: str
    prefill_chunk: int  # tokens per prefill pass; every chunk end is a cache checkpoint
    cache_bytes: int  # the prefix store and the running sequences' KV share this budget
    cache_nodes: int
    pinned_bytes: int
    max_queued: int
    max_queued_per_client: int
    max_active: int  # sequences prefilling or decoding at once
