"""Run jobs to completion on the calling thread, through the engine's own scheduler.

For tests, benchmarks and tools that want replies without a daemon: the same
admission, prefill, batching and storing code the engine runs, with the
calling thread standing in for the engine thread. Each job's own ``emit``
still receives its stream chunks; the final results are returned instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..cache import KvBudget, PrefixStore
from ..models.loaded_model import LoadedModel
from .jobs import DONE, FAILED, GenerateJob
from .model_runner import ModelRunner
from .scheduler import Scheduler


# Without a store, only the jobs' own KV counts against the budget.
STORELESS_KV_BUDGET_BYTES = 8 << 30


def run_inline(
    jobs: list[GenerateJob],
    loaded: LoadedModel,
    store: PrefixStore | None,
    chunk_size: int = 512,
    pass_depth_scale: int | None = None,
    chunks_per_store: int = 1,
) -> list[dict]:
    """Run ``jobs`` together (continuous batching) and return their final results in order.

    The jobs' KV shares the store's budget with what it holds. A job that fails raises its RpcError here.
    ``pass_depth_scale``: passes shorten with depth as the daemon's do on a CPU (prefill.pass_limit).
    ``chunks_per_store``: plain chunk stops are stored this often, as the daemon's are on CUDA (Scheduler._stores_pass).
    """
    finals: dict[int, tuple[str, Any]] = {}

    def collecting(job: GenerateJob) -> GenerateJob:
        def emit(kind: str, payload: Any) -> None:
            if kind in (DONE, FAILED):
                finals[job.job_id] = (kind, payload)
            else:
                job.emit(kind, payload)

        return dataclasses.replace(job, emit=emit)  # same id and cancel flag, results collected here

    kv_budget = store.kv_budget if store is not None else KvBudget(STORELESS_KV_BUDGET_BYTES)
    scheduler = Scheduler(
        store,
        chunk_size,
        max_active=len(jobs),
        kv_budget=kv_budget,
        resolve_model=lambda _: loaded,
        runner=ModelRunner(store, chunk_size),
        pass_depth_scale=pass_depth_scale,
        chunks_per_store=chunks_per_store,
    )
    for job in jobs:
        admitted = scheduler.admit(collecting(job))
        assert admitted, "the KV budget is too small for these jobs"
    while scheduler.has_work:
        scheduler.step()
    results = []
    for job in jobs:
        kind, payload = finals[job.job_id]
        if kind == FAILED:
            raise payload
        results.append(payload)
    return results


def run_one_inline(job: GenerateJob, loaded: LoadedModel, store: PrefixStore | None, chunk_size: int = 512) -> dict:
    """Run one job alone and return its final result."""
    return run_inline([job], loaded, store, chunk_size)[0]
