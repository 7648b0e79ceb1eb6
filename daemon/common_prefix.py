"""The length of the common prefix of two sequences: token ids, edge keys, rendered text.

One helper for every part that needs it (the radix tree's walks, the
scheduler's shared-prefix check, the chat-template message boundaries).
Pure Python, no imports.
"""

from __future__ import annotations

from typing import Sequence

_BLOCK = 64


def common_prefix_length(a: Sequence, b: Sequence, start_b: int = 0) -> int:
    """How many leading items of ``a`` agree with ``b[start_b:]``.

    Works on lists, tuples and strings alike. Blocks are compared as slices,
    which run at C speed, and only the block holding the first difference is
    walked item by item: linear time with a small constant, also for long
    strings.
    """
    limit = min(len(a), len(b) - start_b)
    if limit <= 0:
        return 0
    i = 0
    while i + _BLOCK <= limit and a[i : i + _BLOCK] == b[start_b + i : start_b + i + _BLOCK]:
        i += _BLOCK
    while i < limit and a[i] == b[start_b + i]:
        i += 1
    return i
