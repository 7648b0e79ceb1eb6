"""Engine events onto the event loop: one wake-up per batch of events, not one per token.

The engine thread emits an event per token of every running sequence; a
``call_soon_threadsafe`` each would wake the loop (a write to its self-pipe)
and take the GIL from the engine as many times per decode step as there are
sequences. Here the first event posted while none is pending schedules one
drain, and every event posted before that drain runs rides along with it, so
a decode step of eight sequences costs the loop one wake-up. Order is kept:
events are delivered in the order they were posted.

Each event goes to a callable that runs on the loop (a queue's
``put_nowait``, or a job's relay that writes a streamed chunk straight to its
client: handlers.py), so delivering it costs no task switch of its own.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


class EventMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []

    def post(self, deliver: Callable[[Any], None], item: Any) -> None:
        """Thread-safe: ``deliver(item)`` on the loop, soon. Dropped when the loop is gone.

        ``deliver`` must not raise: it runs inside the drain of everyone's events.
        """
        with self._lock:
            self._pending.append((deliver, item))
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
        for deliver, item in pending:
            deliver(item)
