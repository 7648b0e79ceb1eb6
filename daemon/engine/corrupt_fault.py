"""The ``corrupt_segment`` fault point: a KV segment damaged on its way into the store.

Only a test asks for it (``PREFIXD_FAULTS=corrupt_segment:1``): it is how the
shadow check's tests give the store an entry whose reuse changes the output,
in a real daemon. Engine thread only.
"""

from __future__ import annotations

from ..kv.segments import KVSegment
from .faults import fault_fires


def corrupted_if_asked(segment: KVSegment | None) -> KVSegment | None:
    """The segment as given, or (when the fault fires) with every value negated and shifted (packed: its scales)."""
    if segment is None or not fault_fires("corrupt_segment"):
        return segment
    if segment.bits:
        values = [(codes, -scales + 1, biases) for codes, scales, biases in segment.values]
    else:
        values = [-v + 1 for v in segment.values]
    return KVSegment(list(segment.keys), values, segment.num_tokens, segment.bits)
