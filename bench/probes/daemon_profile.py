#!/usr/bin/env python
"""Where the daemon's decode time goes with N sessions: a step trace and a py-spy profile of the real daemon.

    python bench/probes/daemon_profile.py MODEL_DIR [--sessions 1,4,8] [--tokens 160] [--out DIR] [--daemon-args "..."]

In process, mlx-lm's BatchGenerator decodes 4 rows of the benchmark model in
about 6 ms a step on an H100, one row in 4-6 ms; through the daemon, 4
sessions decoded at 11.5 ms a step and one session at 6.9 ms
(bench/results/2026-12-07-h100-row-linear). This probe says where the rest
goes. For each session count it runs that many greedy sessions (cache off,
one connection each) twice:

* with the engine's step trace on (PREFIXD_TRACE_STEPS): for the plans that
  only decoded, the median time inside the model runner against the median
  interval from one such plan's start to the next; the difference is the
  engine's own work between steps (applying tokens, stop strings, replies);
* under ``py-spy record --idle`` (when py-spy is installed): each thread's
  samples, and the engine thread's time by its innermost Python line and
  by function, so that waiting on the device (an ``mx.eval``, a ``.tolist()``)
  is told from building the step's graph and from the daemon's bookkeeping;
  then under ``--gil``: how much of that time the engine thread held the GIL
  (the rest of its running time it waited for it, or ran native code).

Figures are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO.parent))

from prefixd.daemon.models.blas import preload_blas  # noqa: E402

preload_blas()

from concurrency import decode_throughput  # noqa: E402
from harness import Daemon  # noqa: E402

ENGINE_THREAD = "prefixd-engine"
# The engine thread waiting for work (no sequence to step): left out of its shares.
ENGINE_IDLE = ("Inbox.wait", "LocalInputs.wait")


def decode_plans(trace_path: Path, since: float) -> list[dict]:
    """The trace's decode-only plans started after ``since`` (unix time), in order."""
    plans = []
    for line in trace_path.read_text().splitlines():
        plan = json.loads(line)
        if plan["t"] < since or plan["prefill"] or plan["starts"] or plan["joins"] or plan["finishes"]:
            continue
        if plan["decode"]:
            plans.append(plan)
    return plans


def trace_summary(plans: list[dict]) -> str:
    by_rows: dict[int, list[dict]] = collections.defaultdict(list)
    for plan in plans:
        by_rows[sum(plan["decode"].values())].append(plan)
    lines = []
    for rows, group in sorted(by_rows.items()):
        if len(group) < 5:
            continue
        run_ms = statistics.median(p["ms"] for p in group)
        gaps = [(b["t"] - a["t"]) * 1000 for a, b in zip(group, group[1:]) if 0 < b["t"] - a["t"] < 1.0]
        gap_ms = statistics.median(gaps) if gaps else float("nan")
        lines.append(f"    {rows} rows: {len(group)} steps, in the runner {run_ms:6.2f} ms, start to start {gap_ms:6.2f} ms"
                     f" -> engine's own work between steps {gap_ms - run_ms:5.2f} ms")
    return "\n".join(lines) or "    (too few decode-only steps)"


def profile_summary(raw_path: Path, top: int) -> str:
    """py-spy's raw output (one ``frames count`` line per distinct stack) summarised per thread and per line."""
    threads: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    functions: collections.Counter = collections.Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread, n = frames[0], int(count)
        threads[thread.split(":")[-1].strip() or thread] += n
        if ENGINE_THREAD not in thread or any(idle in frame for frame in frames for idle in ENGINE_IDLE):
            continue
        leaves[short(frames[-1])] += n
        for name in {short(f, with_line=False) for f in frames[1:]}:
            functions[name] += n
    engine = sum(leaves.values())
    out = ["    samples by thread: " + ", ".join(f"{t} {n}" for t, n in threads.most_common(8))]
    if engine:
        out.append(f"    engine thread, innermost line (share of its {engine} samples with work to do):")
        out += [f"      {100 * n / engine:5.1f}%  {name}" for name, n in leaves.most_common(top)]
        out.append("    engine thread, by function (inclusive):")
        # The frames every sample shares (the thread's and the engine loop's) say nothing: left out.
        out += [f"      {100 * n / engine:5.1f}%  {name}" for name, n in functions.most_common(top + 8)
                if n < 0.98 * engine][:top]
    return "\n".join(out)


def short(frame: str, with_line: bool = True) -> str:
    """``func (path/to/file.py:123)`` -> ``func file.py:123`` (or ``func file.py``)."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    path, _, line = where.rpartition(":")
    where = f"{Path(path).name}:{line}" if with_line else Path(path).name
    return f"{name} {where}"


def sessions_under_spy(daemon: Daemon, sessions: int, tokens: int, raw_path: Path, mode: str) -> float:
    spy = shutil.which("py-spy")
    command = [spy, "record", "-p", str(daemon.proc.pid), "-o", str(raw_path), "-f", "raw", "-r", "250",
               "--nonblocking", "--threads", f"--{mode}"]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    row = decode_throughput(daemon.socket_path, sessions, tokens)
    recorder.send_signal(signal.SIGINT)
    try:
        _, err = recorder.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        recorder.kill()
        err = b"py-spy did not stop"
    if not raw_path.exists():
        print(f"    py-spy wrote nothing: {err.decode(errors='replace')[-300:]}")
    return row["decode_aggregate_tok_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sessions", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--out", type=Path, default=None, help="keep the trace and the raw profiles here")
    parser.add_argument("--daemon-args", default="", help="more arguments for the daemon, as one string")
    args = parser.parse_args()
    extra = args.daemon_args.split()
    has_spy = shutil.which("py-spy") is not None
    if not has_spy:
        print("py-spy is not installed: step trace only")
    with tempfile.TemporaryDirectory(prefix="pdprofile") as workdir:
        out = args.out or Path(workdir)
        out.mkdir(parents=True, exist_ok=True)
        trace = out / "steps.jsonl"
        trace.unlink(missing_ok=True)
        os.environ["PREFIXD_TRACE_STEPS"] = str(trace)
        with Daemon(args.model, Path(workdir), extra) as daemon:
            decode_throughput(daemon.socket_path, 2, 16)  # warm-up: first passes at these shapes
            for sessions in [int(s) for s in args.sessions.split(",")]:
                decode_throughput(daemon.socket_path, sessions, 16)
                since = time.time()
                row = decode_throughput(daemon.socket_path, sessions, args.tokens)
                per_session = statistics.median(row["per_session_tok_s"])
                print(f"{sessions} sessions: {row['decode_aggregate_tok_s']:.1f} tok/s aggregate (traced);"
                      f" the daemon's own decode rate per session, median {per_session:.1f} tok/s")
                print(trace_summary(decode_plans(trace, since)))
                if not has_spy:
                    continue
                for mode in ("idle", "gil"):
                    raw = out / f"spy-{sessions}-{mode}.txt"
                    tok_s = sessions_under_spy(daemon, sessions, args.tokens, raw, mode)
                    print(f"  under py-spy --{mode}: {tok_s:.1f} tok/s aggregate")
                    if raw.exists():
                        print(profile_summary(raw, args.top if mode == "idle" else 6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
