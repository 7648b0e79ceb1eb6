"""One job's engine events on the event loop: streamed chunks go straight out, the end goes to the waiting task.

Why not a queue for every event: a streamed answer sends a chunk per token,
and each one used to wake the request's task through an ``asyncio.Queue``
(a future, a task step, the coroutine resumed through its awaits) before the
chunk reached the client's outbox. On a GPU that work holds the GIL the
engine thread needs to build its next step; on a small machine it also takes
a core from MLX. The relay runs in the mailbox's drain (event_mailbox.py)
and hands each chunk to ``on_chunk`` there; only the job's end (DONE or
FAILED), or an error raised while relaying a chunk, wakes the task.

Order holds: the mailbox delivers a job's events in the order the engine
posted them, so every chunk has gone out before the task sees the end.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from ..engine.faults import fault_point
from ..engine.jobs import CHUNK

RELAY_FAILED = "relay_failed"  # payload: the exception raised while relaying a chunk


class ChunkRelay:
    """``deliver`` is the mailbox's target for one job; the task awaits ``ends`` for the rest."""

    def __init__(self, on_chunk: Callable[[dict], None] | None):
        self.on_chunk = on_chunk
        # The job's answer reader (tool calls), set once the prompt is prepared, before the job starts.
        self.reader: Any = None
        self.ends: asyncio.Queue = asyncio.Queue()  # (kind, payload): DONE, FAILED or RELAY_FAILED
        self._relaying = True

    def deliver(self, event: tuple[str, Any]) -> None:
        """On the loop, inside the mailbox's drain: never raises."""
        kind, payload = event
        if kind != CHUNK:
            self.ends.put_nowait(event)
            return
        if not self._relaying:
            return  # nobody waits for this job's text any more
        try:
            fault_point("relay_chunk")
            chunk = self.reader.chunk(payload) if self.reader is not None else payload
            if self.on_chunk is not None:
                self.on_chunk(chunk)
        except Exception as exc:  # the request fails with it, in its own task; the drain goes on
            self._relaying = False
            self.ends.put_nowait((RELAY_FAILED, exc))

    def stop(self) -> None:
        """Drop the job's further chunks (its requester went away, or the request failed)."""
        self._relaying = False
