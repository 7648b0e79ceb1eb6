"""The engine's inbox: quick control calls first, then generate jobs in fair order.

Thread-safe; the asyncio front puts, the engine thread takes. Generate jobs
queue per client and are served round-robin across clients, so one client
with many queued requests cannot starve another: each client with work gets
the engine in turn, oldest request first within a client. Beyond the limits
a put fails at once with OVERLOADED instead of waiting.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any, Callable

from ...protocol.errors import ErrorCode, RpcError
from .jobs import GenerateJob


class Inbox:
    def __init__(self, max_queued: int, max_queued_per_client: int):
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self._lock = threading.Condition()
        self._controls: deque[Callable[[], Any]] = deque()
        self._per_client: OrderedDict[str, deque[GenerateJob]] = OrderedDict()
        self._num_queued = 0
        self._closed = False

    def put_job(self, job: GenerateJob) -> None:
        """Queue a generate job, or raise OVERLOADED / SHUTTING_DOWN at once."""
        with self._lock:
            if self._closed:
                raise RpcError(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
            queue = self._per_client.get(job.client_id)
            if self._num_queued >= self.max_queued:
                raise RpcError(ErrorCode.OVERLOADED, f"{self._num_queued} requests already queued (limit {self.max_queued}); retry later")
            if queue is not None and len(queue) >= self.max_queued_per_client:
                raise RpcError(
                    ErrorCode.OVERLOADED,
                    f"this connection already has {len(queue)} requests queued (limit {self.max_queued_per_client})",
                )
            if queue is None:
                queue = self._per_client[job.client_id] = deque()
            queue.append(job)
            self._num_queued += 1
            self._lock.notify()

    def put_control(self, call: Callable[[], Any]) -> None:
        with self._lock:
            self._controls.append(call)
            self._lock.notify()

    def take_control(self) -> Callable[[], Any] | None:
        with self._lock:
            return self._controls.popleft() if self._controls else None

    def take_job(self) -> GenerateJob | None:
        """The next job round-robin across clients, without waiting."""
        with self._lock:
            return self._pop_job()

    def take(self, timeout: float) -> Callable[[], Any] | GenerateJob | None:
        """Next control call, else the next job round-robin; None after ``timeout``."""
        with self._lock:
            if not self._controls and not self._num_queued:
                self._lock.wait(timeout)
            if self._controls:
                return self._controls.popleft()
            return self._pop_job()

    def _pop_job(self) -> GenerateJob | None:
        if not self._num_queued:
            return None
        client_id, queue = next(iter(self._per_client.items()))
        job = queue.popleft()
        self._num_queued -= 1
        del self._per_client[client_id]
        if queue:  # the client goes to the back of the line
            self._per_client[client_id] = queue
        return job

    def close(self) -> list[GenerateJob]:
        """Refuse new jobs; return the queued ones so the caller can fail them."""
        with self._lock:
            self._closed = True
            jobs = [job for queue in self._per_client.values() for job in queue]
            self._per_client.clear()
            self._num_queued = 0
            self._lock.notify_all()
            return jobs

    def counts(self) -> dict[str, Any]:
        with self._lock:
            return {
                "queued": self._num_queued,
                "queued_per_client": {client: len(q) for client, q in self._per_client.items()},
            }
