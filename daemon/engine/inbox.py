"""The engine's inbox: quick control calls first, then generate jobs in fair order.

Thread-safe; the asyncio front puts, the engine thread takes. Generate jobs
queue per lane (a socket connection, or one HTTP client program on one host:
GenerateJob.fair_lane) and are served round-robin across lanes, so one client
with many queued requests cannot starve another, however many connections it
opens: each lane with work gets the engine in turn, oldest request first
within a lane. The queue limits count per connection (client_id), and a
quarter of the whole queue is kept for other lanes, so a burst from one
program (hundreds of HTTP connections, each within its own limit) cannot fill
the line for everyone. Beyond the limits a put fails at once with OVERLOADED
instead of waiting.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any, Callable

from ...protocol.errors import ErrorCode, RpcError
from .jobs import FAILED, GenerateJob


class Inbox:
    def __init__(self, max_queued: int, max_queued_per_client: int):
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self._lock = threading.Condition()
        self._controls: deque[Callable[[], Any]] = deque()
        self._per_lane: OrderedDict[str, deque[GenerateJob]] = OrderedDict()  # the next lane to serve first
        self._queued_per_client: dict[str, int] = {}
        self._in_line_per_lane: dict[str, int] = {}  # queued + reserved
        self._num_queued = 0
        # Places taken by requests still being encoded on the front's worker threads:
        # they count against the limits, so a burst cannot pass them while it encodes.
        self._reserved: dict[str, int] = {}
        self._num_reserved = 0
        self._closed_error: RpcError | None = None  # what a put_job gets once closed
        self._controls_error: RpcError | None = None  # what a put_control gets once the engine is gone

    @property
    def max_queued_per_lane(self) -> int:
        """What one lane may hold: all but the quarter of the line kept for the others."""
        return self.max_queued - self.max_queued // 4

    def reserve(self, client_id: str, lane: str | None = None) -> None:
        """Take a place in line for a request about to be encoded, or raise what put_job would raise.

        ``lane`` is the job's fair_lane (default: its connection). The place is
        given back by ``put_job(job, reserved=True)`` or by ``release``.
        """
        lane = lane or client_id
        with self._lock:
            self._check_room(client_id, lane)
            self._reserved[client_id] = self._reserved.get(client_id, 0) + 1
            self._num_reserved += 1
            _add(self._in_line_per_lane, lane, +1)

    def release(self, client_id: str, lane: str | None = None) -> None:
        """Give back a reserved place (the request failed or was cancelled before it was queued)."""
        with self._lock:
            self._unreserve(client_id, lane or client_id)

    def _unreserve(self, client_id: str, lane: str) -> None:
        if self._reserved.get(client_id, 0) <= 0:
            return
        self._num_reserved -= 1
        _add(self._reserved, client_id, -1)
        _add(self._in_line_per_lane, lane, -1)

    def put_job(self, job: GenerateJob, reserved: bool = False) -> None:
        """Queue a generate job, or raise OVERLOADED / SHUTTING_DOWN / ENGINE_DEAD at once.

        ``reserved``: the job holds a place taken by ``reserve``, which it now fills.
        """
        with self._lock:
            if reserved:
                self._unreserve(job.client_id, job.fair_lane)
            self._check_room(job.client_id, job.fair_lane)
            queue = self._per_lane.get(job.fair_lane)
            if queue is None:
                queue = self._per_lane[job.fair_lane] = deque()
            queue.append(job)
            self._count(job, +1)
            self._lock.notify()

    @property
    def has_jobs(self) -> bool:
        return self._num_queued > 0  # a plain read: a stale answer costs one loop iteration

    def _check_room(self, client_id: str, lane: str) -> None:
        if self._closed_error is not None:
            raise _fresh(self._closed_error)
        if self._queued_per_client.get(client_id):
            self._drop_cancelled(client_id)
        if self._num_queued + self._num_reserved >= self.max_queued:
            self._drop_cancelled(None)
        in_line = self._num_queued + self._num_reserved
        if in_line >= self.max_queued:
            raise RpcError(
                ErrorCode.OVERLOADED, f"{in_line} requests already queued (limit {self.max_queued}); retry later"
            )
        mine = self._queued_per_client.get(client_id, 0) + self._reserved.get(client_id, 0)
        if mine >= self.max_queued_per_client:
            raise RpcError(
                ErrorCode.OVERLOADED,
                f"this connection already has {mine} requests queued (limit {self.max_queued_per_client})",
            )
        ours = self._in_line_per_lane.get(lane, 0)
        if ours >= self.max_queued_per_lane:
            raise RpcError(
                ErrorCode.OVERLOADED,
                f"this client already has {ours} requests queued (limit {self.max_queued_per_lane}: "
                f"a quarter of the queue is kept for other clients); retry later",
            )

    def drop_cancelled(self, client_id: str) -> None:
        with self._lock:
            self._drop_cancelled(client_id)

    def _drop_cancelled(self, client_id: str | None) -> None:
        """Answer and forget queued jobs that were cancelled (one connection's, or everyone's): they hold no place in line."""
        for lane, queue in list(self._per_lane.items()):
            dropped = [job for job in queue if job.cancelled.is_set() and client_id in (None, job.client_id)]
            if not dropped:
                continue
            for job in dropped:
                job.emit(FAILED, RpcError(ErrorCode.CANCELLED, "cancelled before it started"))
                self._count(job, -1)
            kept = deque(job for job in queue if job not in dropped)
            if kept:
                self._per_lane[lane] = kept
            else:
                del self._per_lane[lane]

    def _count(self, job: GenerateJob, change: int) -> None:
        self._num_queued += change
        _add(self._queued_per_client, job.client_id, change)
        _add(self._in_line_per_lane, job.fair_lane, change)

    def put_control(self, call: Callable[[], Any]) -> None:
        """Queue a control call; raises once the engine is gone (drain_controls), so no caller waits forever."""
        with self._lock:
            if self._controls_error is not None:
                raise _fresh(self._controls_error)
            self._controls.append(call)
            self._lock.notify()

    def take_control(self) -> Callable[[], Any] | None:
        with self._lock:
            return self._controls.popleft() if self._controls else None

    def take_job(self) -> GenerateJob | None:
        """The next job round-robin across lanes, without waiting."""
        with self._lock:
            return self._pop_job()

    def wait(self, timeout: float) -> bool:
        """Wait until a control call or a job is queued, at most ``timeout``; True if one is. Takes nothing.

        What arrived is taken in the engine's next iteration, in its usual
        order: after anything that must come first (ranks: the state digest).
        """
        with self._lock:
            if not self._controls and not self._num_queued:
                self._lock.wait(timeout)
            return bool(self._controls or self._num_queued)

    def run_controls(self) -> None:
        """Run every queued control call, here (the engine thread), oldest first."""
        while (call := self.take_control()) is not None:
            call()

    def _pop_job(self) -> GenerateJob | None:
        if not self._num_queued:
            return None
        lane, queue = next(iter(self._per_lane.items()))
        job = queue.popleft()
        self._count(job, -1)
        del self._per_lane[lane]
        if queue:  # the lane goes to the back of the line
            self._per_lane[lane] = queue
        return job

    def close(self, error: RpcError | None = None) -> list[GenerateJob]:
        """Refuse new jobs with ``error`` (default SHUTTING_DOWN); return the queued ones so the caller can fail them."""
        with self._lock:
            if self._closed_error is None:
                self._closed_error = error or RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            jobs = [job for queue in self._per_lane.values() for job in queue]
            self._per_lane.clear()
            for job in jobs:
                self._count(job, -1)
            self._lock.notify_all()
            return jobs

    def drain_controls(self, error: RpcError) -> list[Callable[[], Any]]:
        """The engine is gone: refuse later control calls with ``error``; return the pending ones to fail."""
        with self._lock:
            self._controls_error = error
            calls = list(self._controls)
            self._controls.clear()
            return calls

    def counts(self) -> dict[str, Any]:
        with self._lock:
            self._drop_cancelled(None)
            # A request still being encoded holds its place in line (see reserve), so it counts as
            # queued here as it does against the limits: a client that was just accepted sees itself.
            per_client = dict(self._queued_per_client)
            for client, count in self._reserved.items():
                per_client[client] = per_client.get(client, 0) + count
            return {
                "queued": self._num_queued + self._num_reserved,
                "encoding": self._num_reserved,
                "queued_per_client": {client: n for client, n in per_client.items() if n},
            }


def _add(counts: dict[str, int], key: str, change: int) -> None:
    """counts[key] += change, without keeping zeros (the dicts stay as small as the line)."""
    count = counts.get(key, 0) + change
    if count:
        counts[key] = count
    else:
        counts.pop(key, None)


def _fresh(err: RpcError) -> RpcError:
    """A new exception object per raise: one shared instance would collect every caller's traceback."""
    return RpcError(err.code, err.message, err.data)
