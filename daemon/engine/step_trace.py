"""An optional trace of the engine's steps: one JSON line per plan the model runner ran.

    PREFIXD_TRACE_STEPS=/tmp/steps.jsonl prefixd serve ...

Why: a client's wait for its first token is the sum of the plans the engine
ran before it (other clients' prefill passes, decode steps, forks, stores).
The reply's timings say how long it waited in line and in prefill; this says
what the engine was doing meanwhile and how long each piece took, on any
device, without a profiler attached. Each line:

    {"t": unix time at the start, "ms": run time, "decode": {model: rows},
     "prefill": [[request_id, from, to]], "starts": [request_id], "joins": n, "finishes": n, "drops": n}

The file is written through an ordinary buffered writer (a line is a copy
into the buffer; the disk write happens once per buffer), and closed when the
engine stops. Engine thread only.
"""

from __future__ import annotations

import json
import os
from typing import IO

from .step_plan import StepPlan

TRACE_ENV = "PREFIXD_TRACE_STEPS"


class StepTrace:
    def __init__(self, path: str):
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    @classmethod
    def from_environment(cls) -> StepTrace | None:
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def describe(self, plan: StepPlan, decode_rows: dict[str, int]) -> dict:
        """The plan as a trace line, taken before it runs (the run moves the sequences on)."""
        return {
            "decode": {model: decode_rows.get(model, 0) for model in plan.decode},
            "prefill": [[p.seq.job.request_id, p.seq.position, p.run_to] for p in plan.prefill],
            "starts": [s.seq.job.request_id for s in plan.starts],
            "joins": len(plan.joins),
            "finishes": len(plan.finishes),
            "drops": len(plan.drops),
        }

    def write(self, line: dict, started_at: float, seconds: float) -> None:
        if self._file is None:
            return
        record = {"t": round(started_at, 6), "ms": round(seconds * 1000, 3), **line}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
