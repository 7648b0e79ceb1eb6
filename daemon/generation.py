"""Run jobs to completion on the calling thread, through the engine's own scheduler.

For tests, benchmarks and tools that want a reply without a daemon: the same
admission, prefill, batching and storing code the engine runs, with the
calling thread as the engine thread.
"""

from __future__ import annotations

from typing import Any

from .jobs import DONE, FAILED, GenerateJob
from .loaded_model import LoadedModel
from .scheduler import Scheduler


def run_jobs(jobs: list[GenerateJob], loaded: LoadedModel, store: Any, chunk_size: int = 512, kv_budget_bytes: int = 8 << 30) -> list[dict]:
    """Run ``jobs`` together (continuous batching) and return their final results in order.

    A job that fails raises its RpcError here.
    """
    results: dict[int, Any] = {}
    for job in jobs:
        forward = job.emit

        def emit(kind: str, payload: Any, job=job, forward=forward) -> None:
            if kind in (DONE, FAILED):
                results[job.job_id] = (kind, payload)
            else:
                forward(kind, payload)

        job.emit = emit
    scheduler = Scheduler(store, chunk_size, max_active=len(jobs), kv_budget_bytes=kv_budget_bytes, resolve_model=lambda _: loaded)
    for job in jobs:
        assert scheduler.admit(job)
    while scheduler.has_work:
        scheduler.step()
    out = []
    for job in jobs:
        kind, payload = results[job.job_id]
        if kind == FAILED:
            raise payload
        out.append(payload)
    return out


def run_job(job: GenerateJob, loaded: LoadedModel, store: Any, chunk_size: int = 512) -> dict:
    """Run one job alone and return its final result."""
    return run_jobs([job], loaded, store, chunk_size)[0]
