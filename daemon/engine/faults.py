"""Fault points: how tests make the engine fail at a chosen step, in a real daemon.

``PREFIXD_FAULTS="decode_step:2,loop:*"`` raises ``InjectedFault`` the 2nd time
the engine reaches ``decode_step`` and every time it reaches ``loop``. Unset
(the normal case), ``fault_point`` is one dictionary lookup. Points are named
where they are placed: admit, start_prefill, prefill, first_token,
decode_step, token, finish, store_answer, control, loop, warm_up, and in the front relay_chunk (a
streamed chunk on its way to the client: front/chunk_relay.py). One point corrupts
instead of raising (``fault_fires``): corrupt_segment, a stored KV segment
changed on its way into the store, so the shadow check has something to find.
"""

from __future__ import annotations

import os
from collections import Counter

FAULTS_ENV = "PREFIXD_FAULTS"


class InjectedFault(RuntimeError):
    """A failure a test asked for; the engine treats it like any other exception."""


class FaultPoints:
    def __init__(self, spec: str):
        self._plan: dict[str, int | None] = {}  # point -> the hit that fails (None: every hit)
        self._hits: Counter[str] = Counter()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            point, _, when = item.partition(":")
            if when not in ("*", "") and not when.isdigit():
                raise ValueError(f"{FAULTS_ENV}: {item!r} is not point:N or point:*")
            self._plan[point] = None if when == "*" else int(when or 1)

    def hit(self, point: str) -> None:
        if self.fires(point):
            raise InjectedFault(f"injected fault at {point} (hit {self._hits[point]})")

    def fires(self, point: str) -> bool:
        if point not in self._plan:
            return False
        self._hits[point] += 1
        when = self._plan[point]
        return when is None or when == self._hits[point]


FAULTS = FaultPoints(os.environ.get(FAULTS_ENV, ""))


def fault_point(point: str) -> None:
    """Raise here if the test running this daemon asked for a fault at ``point``."""
    FAULTS.hit(point)


def fault_fires(point: str) -> bool:
    """True here if the test running this daemon asked for a (non-raising) fault at ``point``."""
    return FAULTS.fires(point)
