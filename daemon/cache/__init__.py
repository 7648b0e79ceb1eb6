"""The global prefix-cache store: radix trees of opaque KV payloads under one budget.

Pure Python, no MLX: ``kv/`` gives the payloads their contents, and the unit
tests drive the store with fakes. Only the engine thread uses it.
"""

from .cache_report import CacheReport
from .eviction import LruPolicy, RecencyCostPolicy
from .kv_budget import KvBudget
from .prefix_store import PrefixStore
from .store_types import (
    CHECKPOINT_KINDS,
    CacheStats,
    CheckpointKind,
    Checkpoints,
    HitKind,
    InsertResult,
    Lease,
    Match,
    MissReason,
    NotStored,
    PinBudgetExceeded,
    PinResult,
    PrefixStoreError,
    Segment,
    Snapshot,
    StoredEdge,
    StoreStats,
)

__all__ = [
    "CHECKPOINT_KINDS",
    "CacheReport",
    "CacheStats",
    "CheckpointKind",
    "Checkpoints",
    "HitKind",
    "InsertResult",
    "KvBudget",
    "Lease",
    "LruPolicy",
    "Match",
    "MissReason",
    "NotStored",
    "PinBudgetExceeded",
    "PinResult",
    "PrefixStore",
    "PrefixStoreError",
    "RecencyCostPolicy",
    "Segment",
    "Snapshot",
    "StoreStats",
    "StoredEdge",
]
