"""Engine events onto the event loop: one wake-up per batch of events, not one per token.

The engine thread emits an event per token of every running sequence; a
``call_soon_threadsafe`` each would wake the loop (a write to its self-pipe)
and take the GIL from the engine as many times per decode step as there are
sequences. Here the first event posted while none is pending schedules one
drain, and every event posted before that drain runs rides along with it, so
a decode step of eight sequences costs the loop one wake-up. Order is kept:
per queue, events arrive in the order they were posted.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class EventMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """Thread-safe: ``queue.put_nowait(item)`` on the loop, soon. Dropped when the loop is gone."""
        with self._lock:
            self._pending.append((queue, item))
            if len(self._pending) > 1:
                return  # a drain is scheduled and will take this one along
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the daemon is exiting
            with self._lock:
                self._pending.clear()

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)
